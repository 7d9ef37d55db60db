"""Time to first audio over the speech socket against the speech endpoint, on a running server.

For the same clause, `--runs` times each (after one untimed run of each), alternating:

- http: `POST /v1/audio/speech` (`stream_format: "audio"`, pcm), from sending the request to the
  first audio byte;
- socket, whole: the clause with the end message, from sending that message to the first binary
  message (the socket's own cost on the same work);
- socket, arriving: the clause as a language model's tokens (a word a message, `--gap` ms apart),
  then the next word, which completes the clause (its sentence end needs the whitespace after it):
  from sending that word to the first binary message.

The arriving path speaks the clause as its first part, so the three time the same work; the target
is socket within 10 ms of http. Medians with min-max as Markdown on stdout.

    python tools/socket_latency.py --url http://127.0.0.1:8910 --runs 20
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from urllib.parse import urlsplit

from websockets.sync.client import connect

CLAUSE = "Hi, how are you today?"
PATH = "/v1/audio/speech/stream"


def http_ttfa(url: str, text: str, headers: dict) -> float:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"input": text, "greedy": True, "stream_format": "audio", "response_format": "pcm"})
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/audio/speech", body=body, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"socket_latency: HTTP {resp.status}: {resp.read()[:300]!r}")
        resp.read1(1)
        ttfa = time.perf_counter() - t0
        resp.read()
        return ttfa
    finally:
        conn.close()


def socket_ttfa(url: str, text: str, headers: dict, arriving: bool, gap: float) -> float:
    ws_url = url.replace("http://", "ws://").replace("https://", "wss://") + PATH
    with connect(ws_url, additional_headers=headers, compression=None, max_size=None) as ws:
        ws.send(json.dumps({"type": "start", "greedy": True, "response_format": "pcm"}))
        if arriving:
            for i, word in enumerate(text.split(" ")):
                ws.send(json.dumps({"type": "text", "text": word if i == 0 else " " + word}))
                time.sleep(gap)
            last = {"type": "text", "text": " And"}  # (the whitespace after "?" makes the clause a part)
        else:
            last = {"type": "end", "text": text}
        t0 = time.perf_counter()
        ws.send(json.dumps(last))
        while not isinstance(message := ws.recv(timeout=300), bytes):
            if json.loads(message)["type"] == "error":
                raise SystemExit(f"socket_latency: {message}")
        ttfa = time.perf_counter() - t0
        if arriving:
            ws.send(json.dumps({"type": "end"}))
        for _ in ws:  # (to the server's close)
            pass
        return ttfa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8910")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--gap", type=float, default=20.0, help="ms between the arriving path's words")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ways = {"http": lambda: http_ttfa(args.url, CLAUSE, headers),
            "socket, whole": lambda: socket_ttfa(args.url, CLAUSE, headers, False, 0),
            "socket, arriving": lambda: socket_ttfa(args.url, CLAUSE, headers, True, args.gap / 1e3)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for run in range(args.runs + 1):
        for name, way in ways.items():
            ttfa = way()
            if run:  # (the first of each is not timed)
                times[name].append(ttfa * 1e3)
    print(f"Time to first audio at {args.url}, {args.runs} runs, text {CLAUSE!r}\n")
    print("| way | TTFA p50 (ms) | min-max |\n|---|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {statistics.median(ms):.1f} | {min(ms):.1f}-{max(ms):.1f} |")


if __name__ == "__main__":
    main()
