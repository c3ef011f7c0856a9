"""Drive load at a proxy: python load.py URL n conc stream"""
import asyncio, sys, json, time
sys.path.insert(0, "/work/main")
from bench.proxy_overhead import Conn, Phase, Path_, run_phase
url, n, conc, stream = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
ph = Phase()
asyncio.run(run_phase(Path_("x", url), n, conc, stream, ph))
print(f"req {ph.requests} err {ph.errors} wall {ph.wall:.2f} rps {ph.requests/ph.wall:.1f} chunks {ph.chunks}")
