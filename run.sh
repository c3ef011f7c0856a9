#!/bin/bash
# usage: run.sh addon|bare N CONC STREAM
set -e
cd /work/main
MODE=$1; N=$2; C=$3; S=$4
exec 3< <(sleep 1000)
ENG_OUT=$(mktemp)
.venv/bin/python bench/proxy_overhead.py --serve-engine --chunk-delay 0.002 <&3 > $ENG_OUT &
EPID=$!
while [ ! -s $ENG_OUT ]; do sleep 0.1; done
ENG=$(head -1 $ENG_OUT)
PORT=$(.venv/bin/python -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
T=$(mktemp -d)
ARGS=(--listen-host 127.0.0.1 -p $PORT --mode reverse:$ENG --set connection_strategy=lazy --set flow_detail=0 --set confdir=$T/conf -s /tmp/prof/profaddon.py)
if [ $MODE = bare ]; then printf 'def responseheaders(flow):\n    if flow.response.headers.get("content-type","").startswith("text/event-stream"):\n        flow.response.stream = True\n' > $T/h.py; ARGS+=(-s $T/h.py); else ARGS+=(-s addons/openforge.py --set openforge_upstream_url=$ENG --set openforge_flow_dir=$T/flows ${EXTRA}); fi
env -u OPENFORGE_UPSTREAM_URL PROF_OUT=/tmp/prof/$MODE.prof .venv/bin/mitmdump "${ARGS[@]}" > $T/log 2>&1 &
MPID=$!
for i in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.1; done
.venv/bin/python /tmp/prof/load.py http://127.0.0.1:$PORT 20 2 0 >/dev/null
.venv/bin/python /tmp/prof/load.py http://127.0.0.1:$PORT $N $C $S
kill -TERM $MPID; wait $MPID || true
kill $EPID; exec 3<&-
tail -3 $T/log
