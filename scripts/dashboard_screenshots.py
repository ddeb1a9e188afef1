"""Screenshots of the dashboard on real run directories, in Debian's Chromium through Playwright.

    .venv/bin/python scripts/dashboard_screenshots.py --out docs/img --prefix demo RUN [RUN ...] \
        [--page overview=/ --page tasks=/tasks?split=eval-heldout ...]

Serves the runs as `legorl dashboard RUN [RUN ...]` does (the first run's pages, a Compare page when
there are several; a run still training is read live), opens each page, waits for its charts or tables,
and saves `OUT/PREFIX-NAME.png` (full page). Any JavaScript error fails the script, as in the browser test
(tests/test_dashboard_browser.py). docs/monitoring.md's real-run pictures come from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from legorl.monitor.server import served_in_thread

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
DEFAULT_PAGES = ["overview=/", "tasks=/tasks?split=eval-heldout", "behaviour=/behaviour"]
# what each page shows once its data is drawn (a chart's svg, a table)
READY = {"/": "#phase-label", "/tasks": "#task-grid, #grid p", "/compare": "#compare-runs", "/behaviour": "svg",
         "/failures": "table", "/rollouts": "table", "/alarms": "#thresholds"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("test-artifacts/dashboard"))
    ap.add_argument("--prefix", default="dashboard")
    ap.add_argument("--page", action="append", help="NAME=PATH (repeatable); default: " + " ".join(DEFAULT_PAGES))
    ap.add_argument("--width", type=int, default=1400)
    args = ap.parse_args()
    pages = [p.split("=", 1) for p in (args.page or DEFAULT_PAGES)]
    if len(args.runs) > 1 and not args.page:
        pages.append(["compare", "/compare"])

    errors: list[str] = []
    args.out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    with served_in_thread(args.runs[0], args.runs[1:]) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        page = browser.new_page(viewport={"width": args.width, "height": 1000})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        for name, path in pages:
            page.goto(base + path)
            page.wait_for_selector(READY.get(path.split("?")[0], "body"), timeout=60_000)
            page.wait_for_timeout(1500)  # the charts' second fetch (live pages poll)
            target = args.out / f"{args.prefix}-{name}.png"
            page.screenshot(path=str(target), full_page=True)
            print(target)
        browser.close()
    if errors:
        raise SystemExit(f"JavaScript errors: {errors}")


if __name__ == "__main__":
    main()
