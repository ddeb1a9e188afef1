"""Grading: fresh-sandbox grader, diff path policy, JUnit parsing, workspace diffs."""

from legorl.grading.diff import workspace_diff
from legorl.grading.grader import grade
from legorl.grading.junit import junit_key, parse_junit
from legorl.grading.policy import filter_diff, is_test_path

__all__ = ["filter_diff", "grade", "is_test_path", "junit_key", "parse_junit", "workspace_diff"]
