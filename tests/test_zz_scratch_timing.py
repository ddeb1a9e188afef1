import asyncio, time, sys
sys.path.insert(0, "/work/main/tests")
from harness_episode import run_episode
from test_harness_openhands import make_script
from legorl.harness.openhands import OpenHandsHarness
from legorl.harness import prefork

def test_timing(tokenizer, tmp_path):
    orig = prefork.PreforkServer.run
    def run(self, *a, **k):
        t = time.monotonic()
        out, rc = orig(self, *a, **k)
        print("\nWALL", round(time.monotonic() - t, 2), out[-400:])
        return out, rc
    prefork.PreforkServer.run = run
    h = OpenHandsHarness(timeout=300, tools=["terminal"])
    seen = []
    for i in range(2):
        d = tmp_path / str(i); d.mkdir()
        asyncio.run(run_episode(h, tokenizer, d, make_script(tokenizer, seen), box_kw={}))
