"""The corpus builder: documentation installed on this machine as English text (``lpbench data corpus``)."""
