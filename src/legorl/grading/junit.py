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
    address, bracket, params = node_id.replace("::()", "").partition("[")  # a parameter id may hold "::"
    path, *rest = address.split("::")
    if not rest:
        raise ValueError(f"not a pytest test id: {node_id!r}")
    module = re.sub(r"\.py$", "", path.replace("/", "."))
    return ".".join([module, *rest[:-1]]), rest[-1] + bracket + params


def parse_junit(path: Path) -> dict[tuple[str, str], str]:
    """{(classname, name): passed|failed|error|skipped}; raises JUnitError if missing/garbled."""
    if not path.is_file():
        raise JUnitError("no JUnit report was written")
    if path.stat().st_size > MAX_JUNIT_BYTES:
        raise JUnitError("JUnit report is implausibly large")
    return parse_junit_text(path.read_bytes())


def parse_junit_text(data: bytes | str) -> dict[tuple[str, str], str]:
    if len(data) > MAX_JUNIT_BYTES:
        raise JUnitError("JUnit report is implausibly large")
    try:
        root = ET.fromstring(data)
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

def to_junit_xml(
    statuses: dict[str, str], name: str = "legorl-verifier", details: dict[str, str] | None = None
) -> str:
    """A JUnit report built on the host from streamed results (the verifier-owned report)."""
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name=name, tests=str(len(statuses)))
    counts = {"failures": 0, "errors": 0, "skipped": 0}
    for node_id, status in statuses.items():
        try:
            classname, test = junit_key(node_id)
        except ValueError:
            classname, test = "", node_id
        case = ET.SubElement(suite, "testcase", classname=classname, name=test, file=node_id.split("::")[0])
        text = (details or {}).get(node_id, "")
        if status in ("failed", "xpassed"):
            ET.SubElement(case, "failure", message=status).text = text
            counts["failures"] += 1
        elif status in ("error", "missing"):
            ET.SubElement(case, "error", message=status).text = text
            counts["errors"] += 1
        elif status in ("skipped", "xfailed"):
            ET.SubElement(case, "skipped", message=status)
            counts["skipped"] += 1
    for k, v in counts.items():
        suite.set(k, str(v))
    return ET.tostring(root, encoding="unicode")
