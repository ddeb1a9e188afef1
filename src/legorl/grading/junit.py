"""JUnit XML (pytest --junitxml) parsing into per-test statuses keyed by pytest node id."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}  # worst status wins on duplicates
MAX_JUNIT_BYTES = 64 * 1024 * 1024


class JUnitError(ValueError):
    pass


def junit_key(node_id: str) -> tuple[str, str]:
    """(classname, name) pytest writes for a node id (mirrors pytest's mangle_test_address)."""
    path, *rest = node_id.replace("::()", "").split("::")
    if not rest:
        raise ValueError(f"not a pytest test id: {node_id!r}")
    module = re.sub(r"\.py$", "", path.replace("/", "."))
    return ".".join([module, *rest[:-1]]), rest[-1]


def parse_junit(path: Path) -> dict[tuple[str, str], str]:
    """{(classname, name): passed|failed|error|skipped}; raises JUnitError if missing/garbled."""
    if not path.is_file():
        raise JUnitError("no JUnit report was written")
    if path.stat().st_size > MAX_JUNIT_BYTES:
        raise JUnitError("JUnit report is implausibly large")
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise JUnitError(f"JUnit report is not valid XML: {e}") from e
    results: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        tags = {child.tag for child in case}
        status = (
            "error" if "error" in tags else "failed" if "failure" in tags else "skipped" if "skipped" in tags
            else "passed"
        )  # fmt: skip
        if key not in results or _RANK[status] > _RANK[results[key]]:
            results[key] = status
    return results
