"""Untrusted text parsed with bounds: JSON and YAML in one line of error or a value lpbench can walk.

``parse_json`` and ``parse_yaml`` turn every way a file can be wrong into a UsageError naming it
(one line, exit 2): not JSON/YAML, nesting deeper than ``MAX_DEPTH`` (the parsers recurse, and a
file nested 50,000 deep would end in a RecursionError), more than ``MAX_NODES`` values (YAML
aliases can repeat one list a billion times), a YAML key that is a list or a mapping, or a key
given twice. Ours, not a library's: PyYAML and ``json`` have no depth or size limit to set.
"""

from __future__ import annotations

import json

from lpbench.errors import UsageError

MAX_DEPTH = 64
MAX_NODES = 1_000_000


def check_structure(value, where: str) -> None:
    """UsageError when ``value`` nests deeper than ``MAX_DEPTH`` or holds more than ``MAX_NODES`` values."""
    stack, nodes = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise UsageError(f"{where}more than {MAX_NODES:,} values")
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise UsageError(f"{where}nested deeper than {MAX_DEPTH} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def parse_json(text: str | bytes, where: str):
    """The JSON value of ``text``; UsageError ("WHERE: ...") when it is not JSON or not bounded."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise UsageError(f"{_prefix(where)}nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError, not UTF-8
        raise UsageError(f"{_prefix(where)}not valid JSON ({' '.join(str(exc).split())[:160]})") from None
    check_structure(value, _prefix(where))
    return value


def _loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last) and a key
    that is a list or a mapping."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (list, dict, set)):
                    raise yaml.constructor.ConstructorError(
                        None, None, "a key is a list or a mapping, not a name", key_node.start_mark
                    )
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


def parse_yaml(text: str, where: str):
    """The YAML value of ``text`` (safe types only); UsageError ("WHERE: ...") when it is not YAML or not bounded."""
    import yaml

    try:
        value = yaml.load(text, Loader=_loader())
    except RecursionError:
        raise UsageError(f"{_prefix(where)}nested deeper than {MAX_DEPTH} levels") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{_prefix(where)}not valid YAML: {' '.join(str(exc).split())[:300]}") from None
    check_structure(value, _prefix(where))
    return value
