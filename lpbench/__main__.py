import sys

from lpbench.cli import main

sys.exit(main())
