#!/usr/bin/env python3
"""Checks of the gateway's OpenAI API against a running mesh (started by gateway_api_test.sh).

One process for every check: on a loaded 2-core VM each python or curl start costs up to
seconds. Env: BASE (gateway URL), BIN, MODEL, RUN, ROUTER, OWNERS, DATA_E1, PID_EXPERT1.
Prints 'FAIL: ...' and exits 1 on the first failure.
"""
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

BASE = os.environ["BASE"]
U = urllib.parse.urlparse(BASE)
RUN = os.environ["RUN"]


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def req(method, path, body=None, headers=None, raw=None, host=None, port=None, timeout=60):
    c = http.client.HTTPConnection(host or U.hostname, port or U.port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    text = r.read().decode("utf-8", "replace")
    c.close()
    try:
        j = json.loads(text)
    except ValueError:
        j = text
    return r.status, j, r


def post(path, body, **kw):
    return req("POST", path, body, **kw)


def expect(status, got, what):
    if got[0] != status:
        fail("%s: status %d, want %d: %s" % (what, got[0], status, str(got[1])[:500]))
    return got[1]


def stream(path, body, on_event=None, port=None, headers=None):
    """POSTs a streaming request; returns the list of data payloads (strings)."""
    c = http.client.HTTPConnection(U.hostname, port or U.port, timeout=60)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request("POST", path, body=json.dumps(body), headers=h)
    r = c.getresponse()
    if r.status != 200:
        return r.status, r.read().decode()
    events, buf = [], b""
    while True:
        line = r.fp.readline()
        if not line:
            break
        line = line.rstrip(b"\r\n")
        if line.startswith(b"data: "):
            events.append(line[6:].decode())
            if on_event and on_event(events, c) is False:
                return 200, events
            if events[-1] == "[DONE]":
                break
    c.close()
    return 200, events


def metrics():
    st, text, _ = req("GET", "/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("moemesh:"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def metric(m, name, label=""):
    for k, v in m.items():
        if k.startswith("moemesh:" + name + "{") and label in k:
            return v
    fail("/metrics lacks " + name)


MODEL_NAME = os.path.basename(os.environ["MODEL"].rstrip("/"))
IDS = [42, 71, 78, 338, 322, 272, 78, 70]

# ---- completions ---------------------------------------------------------------------------
want = subprocess.run([os.environ["BIN"] + "/moemesh", "generate", "--model", os.environ["MODEL"],
                       "--ids", ",".join(map(str, IDS)), "--max-tokens", "12"],
                      capture_output=True, text=True, check=True).stdout.strip()
g = expect(200, post("/v1/completions", {"prompt": IDS, "max_tokens": 12, "temperature": 0,
                                         "ignore_eos": True, "return_token_ids": True}),
           "greedy completion")
got = ",".join(map(str, g["choices"][0]["token_ids"]))
if got != want:
    fail("mesh completion %s != moemesh generate %s" % (got, want))
if (g["usage"]["prompt_tokens"], g["usage"]["completion_tokens"], g["object"]) != \
        (8, 12, "text_completion"):
    fail("usage/object: %s" % g)
d = expect(200, post("/detokenize", {"tokens": g["choices"][0]["token_ids"]}), "detokenize")
if d["prompt"] != g["choices"][0]["text"]:
    fail("completion text %r != /detokenize of its ids %r" % (g["choices"][0]["text"], d["prompt"]))
full = g["choices"][0]["text"]

# skip_special_tokens (vLLM's field): the greedy continuation of "a b c" holds <|im_end|>
# (special) within 200 tokens; dropped from the text by default, kept with false (as /detokenize
# keeps it), the same tokens either way; not a boolean: 400 naming the field.
SP = {"prompt": "a b c", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
      "return_token_ids": True}
dropped = expect(200, post("/v1/completions", SP), "skip_special_tokens default")["choices"][0]
kept = expect(200, post("/v1/completions", dict(SP, skip_special_tokens=False)),
              "skip_special_tokens false")["choices"][0]
if kept["token_ids"] != dropped["token_ids"]:
    fail("skip_special_tokens changed the tokens")
if "<|im_end|>" not in kept["text"] or "<|im_end|>" in dropped["text"]:
    fail("skip_special_tokens: kept %r, dropped %r" % (kept["text"][-80:], dropped["text"][-80:]))
d = expect(200, post("/detokenize", {"tokens": kept["token_ids"]}), "detokenize")
if d["prompt"] != kept["text"]:
    fail("skip_special_tokens false: text %r != /detokenize %r" % (kept["text"], d["prompt"]))
st, j, _ = post("/v1/completions", dict(SP, skip_special_tokens="no"))
if st != 400 or j["error"].get("param") != "skip_special_tokens":
    fail("skip_special_tokens 'no': %s %s" % (st, j))

# A prompt longer than one step's token budget (256): chunked prefill, still equal to generate.
LONG = [(i * 37 + 11) % 500 + 3 for i in range(300)]
want = subprocess.run([os.environ["BIN"] + "/moemesh", "generate", "--model", os.environ["MODEL"],
                       "--ids", ",".join(map(str, LONG)), "--max-tokens", "6"],
                      capture_output=True, text=True, check=True).stdout.strip()
g = expect(200, post("/v1/completions", {"prompt": LONG, "max_tokens": 6, "temperature": 0,
                                         "ignore_eos": True, "return_token_ids": True}),
           "chunked prefill")
if ",".join(map(str, g["choices"][0]["token_ids"])) != want:
    fail("chunked prefill: %s != moemesh generate %s" % (g["choices"][0]["token_ids"], want))
expect(200, post("/v1/completions", {"prompt": "Hello world", "max_tokens": 3, "temperature": 0}),
       "text prompt")
j = expect(200, post("/v1/completions", {"prompt": ["Hello", "world"], "max_tokens": 3, "n": 2,
                                         "seed": 7, "echo": True, "logprobs": 2}),
           "list of prompts, n=2, echo, logprobs")
if len(j["choices"]) != 4 or not j["choices"][2]["text"].startswith("world") or \
        len(j["choices"][0]["logprobs"]["top_logprobs"][0]) != 2 or \
        len(j["choices"][0]["logprobs"]["tokens"]) != 3:
    fail("prompts x n, echo, logprobs shape: %s" % json.dumps(j)[:800])
n_prompt = sum(post("/tokenize", {"prompt": w})[1]["count"] for w in ("Hello", "world"))
if j["usage"]["prompt_tokens"] != n_prompt or j["usage"]["completion_tokens"] != 12:
    fail("usage of 2 prompts x n=2: %s" % j["usage"])
expect(200, post("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2}),
       "list of id lists")
seeded = {"prompt": "abc", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 50,
          "min_p": 0.01, "seed": 123, "return_token_ids": True}
a = expect(200, post("/v1/completions", seeded), "seeded")["choices"][0]["token_ids"]
b = expect(200, post("/v1/completions", seeded), "seeded")["choices"][0]["token_ids"]
if a != b:
    fail("same seed, different tokens: %s %s" % (a, b))

# penalties (vLLM's semantics, common/sampler.c): frequency counts output tokens only, so a
# greedy run equals the plain one up to the first token the plain run repeats; strong penalties
# repeat less; logprobs stay those of the raw logits; the same request gives the same tokens.
def toks(extra):
    body = {"prompt": IDS, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1}
    body.update(extra)
    c = expect(200, post("/v1/completions", body), "penalties %s" % extra)["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


def repeats(t):
    return len(t) - len(set(t))


base, base_lp = toks({})
first = next((k for k in range(len(base)) if base[k] in base[:k]), None)
if first is None:
    fail("penalties: the plain greedy run repeats no token, nothing to test: %s" % base)
seen = []
for extra in ({"frequency_penalty": 2}, {"presence_penalty": 2},
              {"repetition_penalty": 5, "frequency_penalty": 1.5}):
    t, lp = toks(extra)
    seen.append(repeats(t))
    if toks(extra)[0] != t:
        fail("penalties %s: the same request gave other tokens" % extra)
    if repeats(t) >= repeats(base):
        fail("penalties %s: %d repeats, plain %d: %s vs %s" % (extra, repeats(t), repeats(base),
                                                             t, base))
    if "repetition_penalty" not in extra:
        if t[:first] != base[:first] or t[first] == base[first] or lp[:first] != base_lp[:first]:
            fail("penalties %s: %s (logprobs %s) vs plain %s (%s), first repeat at %d" %
                 (extra, t, lp, base, base_lp, first))
sp = {"prompt": "abc", "max_tokens": 8, "temperature": 0.9, "seed": 5, "return_token_ids": True,
      "frequency_penalty": 1, "repetition_penalty": 1.3, "presence_penalty": -0.5}
if expect(200, post("/v1/completions", sp), "seeded penalties")["choices"][0]["token_ids"] != \
        expect(200, post("/v1/completions", sp), "seeded penalties")["choices"][0]["token_ids"]:
    fail("seeded sampling with penalties: same request, different tokens")
print("penalties: plain %d repeats in %d tokens; penalised %s; deterministic: ok"
      % (repeats(base), len(base), seen))
# stop strings: the text ends just before the first one
s = expect(200, post("/v1/completions", {"prompt": IDS, "max_tokens": 12, "temperature": 0,
                                         "ignore_eos": True, "stop": ["never-there", full[3:5]]}),
           "stop")
c = s["choices"][0]
if c["finish_reason"] != "stop" or c["text"] != full[:full.index(full[3:5])]:
    fail("stop string %r: got %r from %r" % (full[3:5], c, full))
# streaming with usage; the streamed text equals the whole text
st, ev = stream("/v1/completions", {"prompt": IDS, "max_tokens": 12, "temperature": 0,
                                    "ignore_eos": True, "stream": True,
                                    "stream_options": {"include_usage": True}})
if ev[-1] != "[DONE]":
    fail("stream does not end with [DONE]: %s" % ev[-3:])
js = [json.loads(e) for e in ev[:-1]]
if js[-1]["choices"] != [] or js[-1]["usage"]["completion_tokens"] != 12 or \
        js[-2]["choices"][0]["finish_reason"] != "length" or \
        any(x["object"] != "text_completion" for x in js):
    fail("completion stream: %s" % ev[-3:])
if "".join(x["choices"][0]["text"] for x in js[:-1]) != full:
    fail("streamed text != the whole text")
# echo while streaming: the prompt's text comes first
st, ev = stream("/v1/completions", {"prompt": "Hello world", "max_tokens": 3, "stream": True,
                                    "echo": True, "seed": 5})
j = expect(200, post("/v1/completions", {"prompt": "Hello world", "max_tokens": 3, "echo": True,
                                         "seed": 5}), "echo")
if "".join(json.loads(e)["choices"][0]["text"] for e in ev[:-1]) != j["choices"][0]["text"] or \
        not j["choices"][0]["text"].startswith("Hello world"):
    fail("streamed echo %s != %s" % (ev, j))

# ---- chat ----------------------------------------------------------------------------------
j = expect(200, post("/v1/chat/completions", {
    "model": MODEL_NAME,
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                 {"role": "assistant", "content": "Hello"},
                 {"role": "user", "content": "More"}],
    "max_completion_tokens": 6, "seed": 1, "logprobs": True, "top_logprobs": 2,
    "chat_template_kwargs": {"enable_thinking": False},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto"}), "chat")
if j["object"] != "chat.completion" or j["choices"][0]["message"]["role"] != "assistant" or \
        len(j["choices"][0]["logprobs"]["content"]) != j["usage"]["completion_tokens"]:
    fail("chat shape: %s" % json.dumps(j)[:600])
st, ev = stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 4, "stream": True})
js = [json.loads(e) for e in ev[:-1]]
if ev[-1] != "[DONE]" or js[0]["choices"][0]["delta"].get("role") != "assistant" or \
        js[-1]["choices"][0]["finish_reason"] not in ("length", "stop") or \
        any(x["object"] != "chat.completion.chunk" for x in js):
    fail("chat stream: %s" % ev)

# ---- models, tokenize, detokenize, metrics, health -----------------------------------------
j = expect(200, req("GET", "/v1/models"), "models")
if j["object"] != "list" or j["data"][0]["id"] != MODEL_NAME:
    fail("models: %s" % j)
j = expect(200, post("/tokenize", {"prompt": "Hello world"}), "tokenize")
if j["tokens"] != IDS or j["count"] != 8:
    fail("tokenize: %s" % j)
expect(200, post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}), "tokenize chat")
j = expect(200, post("/detokenize", {"tokens": IDS}), "detokenize")
if j["prompt"] != "Hello world":
    fail("detokenize: %s" % j)
m = metrics()
for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
             "prompt_tokens_total", "generation_tokens_total",
             "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
             "e2e_request_latency_seconds_count", "gateway_token_overhead_seconds_count",
             "request_success_total"]:
    metric(m, name)
if metric(m, "generation_tokens_total") < 50:
    fail("generation_tokens_total too small: %s" % metric(m, "generation_tokens_total"))
st, h, _ = req("GET", "/health")
# /health needs every role, the drafter too, which this mesh does not run: 503 naming it alone.
if h["missing"] != ["drafter"] or h["roles"]["expert"]["up"] != int(os.environ["OWNERS"]):
    fail("/health: %s" % json.dumps(h)[:400])

# ---- 400 for each bad field, 404, 405, 413 -------------------------------------------------
C, H = "/v1/completions", "/v1/chat/completions"
M = [{"role": "user", "content": "x"}]
BAD = [
    (C, {"max_tokens": 3}, "prompt"), (C, {"prompt": 5}, "prompt"), (C, {"prompt": []}, "prompt"),
    (C, {"prompt": [1, -2]}, "prompt"), (C, {"prompt": [1, 99999]}, "prompt"),
    (C, {"prompt": [[1], "x", 3]}, "prompt"),
    (C, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    (C, {"prompt": "x", "temperature": 3}, "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, "top_p"), (C, {"prompt": "x", "top_k": -5}, "top_k"),
    (C, {"prompt": "x", "min_p": 2}, "min_p"), (C, {"prompt": "x", "seed": "s"}, "seed"),
    (C, {"prompt": "x", "stop": 5}, "stop"), (C, {"prompt": "x", "stop": [""]}, "stop"),
    (C, {"prompt": "x", "n": 0}, "n"), (C, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "x", "echo": 1}, "echo"), (C, {"prompt": "x", "stream": "yes"}, "stream"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    (C, {"prompt": "x", "presence_penalty": -2.5}, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    (C, {"prompt": "x", "frequency_penalty": "lots"}, "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "x", "repetition_penalty": -1.2}, "repetition_penalty"),
    (C, {"prompt": "x", "model": 5}, "model"),
    (H, {"messages": []}, "messages"), (H, {"messages": [{"role": "wizard", "content": "x"}]},
                                        "messages"),
    (H, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (H, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    (H, {"messages": M, "logprobs": "y"}, "logprobs"),
    (H, {"messages": M, "top_logprobs": 3}, "top_logprobs"),
    (H, {"messages": M, "max_completion_tokens": -1}, "max_completion_tokens"),
    (H, {"messages": M, "tools": {}}, "tools"),
    (H, {"messages": M, "tool_choice": "maybe", "tools": []}, "tool_choice"),
    (H, {"messages": M, "chat_template_kwargs": {"enable_thinking": "no"}},
     "chat_template_kwargs.enable_thinking"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"), ("/tokenize", {"prompt": 3}, "prompt"),
]
for path, body, param in BAD:
    st, j, _ = post(path, body)
    if st != 400 or j["error"]["param"] != param or j["error"]["type"] != "invalid_request_error":
        fail("%s %s: %d %s, want 400 naming %s" % (path, body, st, j, param))
st, j, _ = req("POST", C, raw='{"prompt":"x"')
if st != 400 or "not valid JSON" not in j["error"]["message"]:
    fail("invalid JSON: %d %s" % (st, j))
expect(200, post(C, {"prompt": "x", "max_tokens": 2, "unknown_field": {"a": 1}, "user": "u"}),
       "unknown fields are ignored")
j = expect(404, post(C, {"prompt": "x", "model": "gpt-4"}), "unknown model")
if j["error"]["code"] != "model_not_found":
    fail("404 code: %s" % j)
expect(404, req("GET", "/v1/nothing"), "unknown path")
expect(405, req("GET", "/v1/completions"), "GET on a POST route")
j = expect(413, req("POST", C, raw=json.dumps({"prompt": "a" * 70000})), "oversized body")
if j["error"]["code"] != "body_too_large":
    fail("413 body: %s" % j)

# ---- cancellation: a client that leaves frees its sequence and its KV at once ---------------
before = metric(metrics(), "generation_tokens_total")


def leave_after_3(events, conn):
    if len(events) >= 3:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        return False


stream(C, {"prompt": "x", "max_tokens": 500, "stream": True, "ignore_eos": True},
       on_event=leave_after_3)
for _ in range(100):
    m = metrics()
    if metric(m, "num_requests_running") == 0:
        break
    time.sleep(0.05)
if metric(m, "num_requests_running") != 0 or metric(m, "kv_cache_usage_perc") != 0:
    fail("cancelled stream still holds a seq or KV: %s" % m)
if metric(m, "request_success_total", 'finished_reason="abort"') < 1:
    fail("abort not counted")
if metric(m, "generation_tokens_total") - before >= 500:
    fail("the cancelled stream ran to its end")

# ---- 64 concurrent streams, each with exactly the tokens it gives alone ---------------------
def body_i(i):
    return {"prompt": [(7 * i + k) % 500 + 3 for k in range(1 + i % 9)], "max_tokens": 6 + i % 7,
            "temperature": 0.8 if i % 2 else 0, "seed": 1000 + i, "stream": True,
            "ignore_eos": True, "logprobs": 1}


def tokens_of(events):
    if not events or events[-1] != "[DONE]":
        return None
    out = []
    for e in events[:-1]:
        j = json.loads(e)
        if "error" in j:
            return None
        for ch in j["choices"]:
            if ch.get("logprobs"):
                out += list(zip(ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"]))
    return out


alone = []
for i in range(64):
    ev = stream(C, body_i(i))[1]
    alone.append(tokens_of(ev))
    if alone[-1] is None:
        fail("stream %d alone failed: %s" % (i, ev[-3:]))
together = [None] * 64


def run(i):
    together[i] = tokens_of(stream(C, body_i(i))[1])


ts = [threading.Thread(target=run, args=(i,)) for i in range(64)]
for t in ts:
    t.start()
for t in ts:
    t.join()
for i in range(64):
    if together[i] != alone[i]:
        fail("stream %d among 64: %s, alone: %s" % (i, together[i], alone[i]))
print("64 concurrent streams equal alone: ok")

# ---- 401 and 429: a second gateway with a key, one running sequence and a queue of one ------
def spawn_gateway(args, log):
    """Start one more gateway on a fresh loopback port; returns (process, port) once that process
    logged its HTTP listener. A port taken in between (tests run in parallel) is retried."""
    for _ in range(8):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        g = subprocess.Popen([os.environ["BIN"] + "/moemesh-gateway", "--router", os.environ["ROUTER"],
                              "--model", os.environ["MODEL"], "--owners", os.environ["OWNERS"],
                              "--port", str(port)] + args, stderr=open(log, "w"))
        for _ in range(200):
            text = open(log).read()
            if "HTTP on http://" in text:
                return g, port
            if g.poll() is not None:
                break
            time.sleep(0.05)
        if g.poll() is None:
            g.kill()
            g.wait(5)
        if "address already in use" not in open(log).read():
            fail("extra gateway did not start: " + open(log).read()[-500:])
    fail("no free port for an extra gateway after 8 tries")


g2, port2 = spawn_gateway(["--listen", "ipc://%s/gateway-1.ctl" % RUN, "--instance", "1",
                           "--api-key", "sekret", "--shard-max-seqs", "1", "--max-waiting", "1",
                           "--heartbeat-ms", "100", "--keepalive-ms", "20"], RUN + "/gateway2.log")
try:
    for _ in range(100):
        try:
            st = req("GET", "/v1/models", port=port2)[0]
            break
        except OSError:
            time.sleep(0.1)
    j = expect(401, req("GET", "/v1/models", port=port2), "no key")
    j = expect(401, req("GET", "/v1/models", port=port2,
                        headers={"Authorization": "Bearer nope"}), "wrong key")
    if j["error"]["type"] != "authentication_error":
        fail("401 type: %s" % j)
    expect(401, post(C, {"prompt": "x"}, port=port2), "no key on completions")
    AUTH = {"Authorization": "Bearer sekret"}
    expect(200, req("GET", "/v1/models", port=port2, headers=AUTH), "right key")
    res = [None] * 4

    def run2(i):
        st, j, r = post(C, {"prompt": "x", "max_tokens": 400 if i == 0 else 200,
                            "ignore_eos": True}, port=port2, headers=AUTH)
        res[i] = (st, r.getheader("Retry-After"), j)

    def gauge2(name):
        for line in req("GET", "/metrics", port=port2)[1].splitlines():
            if line.startswith("moemesh:" + name + " ") or line.startswith("moemesh:" + name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    # one request seen running first, then three at once: one waits, two are refused (started
    # together, a slow machine could let the first finish before the last arrived)
    ts = [threading.Thread(target=run2, args=(i,)) for i in range(4)]
    ts[0].start()
    for _ in range(500):
        if (gauge2("num_requests_running") or 0) >= 1 or res[0] is not None:
            break
        time.sleep(0.01)
    for t in ts[1:]:
        t.start()
    for t in ts:
        t.join()
    n429 = [r for r in res if r[0] == 429]
    n200 = [r for r in res if r[0] == 200]
    if len(n429) < 1 or len(n200) < 2 or any(r[1] != "1" for r in n429) or \
            any(r[2]["error"]["type"] != "rate_limit_error" for r in n429):
        fail("one running + a queue of one, 4 requests: %s" % [(r[0], r[1]) for r in res])
    # Keep-alive comments while a stream waits in the queue, and a client that leaves while
    # queued is noticed (through them) and dropped from the queue at once.
    long_done = []
    t = threading.Thread(target=lambda: long_done.append(post(
        C, {"prompt": "x", "max_tokens": 400, "ignore_eos": True}, port=port2, headers=AUTH)[0]))
    t.start()
    time.sleep(0.1)
    c2 = http.client.HTTPConnection(U.hostname, port2, timeout=30)
    c2.request("POST", C, body=json.dumps({"prompt": "y", "max_tokens": 5, "stream": True}),
               headers=dict(AUTH, **{"Content-Type": "application/json"}))
    r2 = c2.getresponse()
    first = r2.readline().rstrip(b"\r\n")  # de-chunked
    if r2.status != 200 or first != b": keep-alive":
        fail("queued stream: status %d, first line %r (want a keep-alive comment)" % (r2.status, first))
    c2.sock.shutdown(socket.SHUT_RDWR)
    c2.close()
    for _ in range(100):
        m2 = {}
        for line in req("GET", "/metrics", port=port2)[1].splitlines():
            if line.startswith("moemesh:num_requests_waiting"):
                m2["waiting"] = float(line.rsplit(" ", 1)[1])
        if m2.get("waiting") == 0:
            break
        time.sleep(0.02)
    if m2.get("waiting") != 0 or long_done:
        fail("a queued stream whose client left still waits (%s), or the running request "
             "ended first (%s)" % (m2, long_done))
    t.join()
    if long_done != [200]:
        fail("the running request: %s" % long_done)
finally:
    g2.send_signal(signal.SIGTERM)
    g2.wait(5)

# ---- admission bounded by KV: a gateway capped by --kv-mb 0.4 at 25 blocks (400 tokens) of
# its shard (which states 64 MiB: the gateway flag only lowers what a shard states) ---------
g3, port3 = spawn_gateway(["--listen", "ipc://%s/gateway-2.ctl" % RUN, "--instance", "2",
                           "--kv-mb", "0.4", "--heartbeat-ms", "100"], RUN + "/gateway3.log")
try:
    for _ in range(100):
        try:
            req("GET", "/v1/models", port=port3)
            break
        except OSError:
            time.sleep(0.1)
    j = expect(400, post(C, {"prompt": "x", "max_tokens": 450}, port=port3), "KV need over a shard")
    if "KV" not in j["error"]["message"]:
        fail("KV 400: %s" % j)
    res3 = [None, None]

    def run3(i):
        res3[i] = post(C, {"prompt": [5], "max_tokens": 300, "ignore_eos": True}, port=port3)[0]

    ts = [threading.Thread(target=run3, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    seen = {}
    while any(t.is_alive() for t in ts):
        for line in req("GET", "/metrics", port=port3)[1].splitlines():
            for k in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
                if line.startswith("moemesh:" + k + "{"):
                    v = float(line.rsplit(" ", 1)[1])
                    seen[k] = max(seen.get(k, 0), v)
        time.sleep(0.01)
    for t in ts:
        t.join()
    # 301 tokens = 19 blocks each: the second waits for the first's KV, never runs beside it.
    if res3 != [200, 200] or seen.get("num_requests_waiting") != 1 or \
            seen.get("num_requests_running") != 1 or not 0.5 < seen.get("kv_cache_usage_perc", 0) < 1:
        fail("KV-bounded admission: %s, metrics seen %s" % (res3, seen))
    if "attention/0: admitting 400 KV tokens (65536 stated" not in open(RUN + "/gateway3.log").read():
        fail("the gateway did not log its --kv-mb cap on the shard's statement: %s"
             % open(RUN + "/gateway3.log").read()[-600:])
finally:
    g3.send_signal(signal.SIGTERM)
    g3.wait(5)

# ---- 503: a stream failing midway, a request while an owner is down, then rejoin -------------
def kill_owner_after_3(events, conn):
    if len(events) == 3:
        os.kill(int(os.environ["PID_EXPERT1"]), signal.SIGKILL)


st, ev = stream(C, {"prompt": "x", "max_tokens": 500, "stream": True, "ignore_eos": True},
                on_event=kill_owner_after_3)
if ev[-1] != "[DONE]" or len(ev) < 5:
    fail("stream failing midway: %s" % ev[-3:])
err = json.loads(ev[-2])
if "error" not in err or err["error"]["code"] != "mesh_unavailable":
    fail("stream failing midway: no error event before [DONE]: %s" % ev[-3:])
for _ in range(100):
    st, j, _ = post(C, {"prompt": "x", "max_tokens": 3})
    if st == 503:
        break
    time.sleep(0.05)
if st != 503 or j["error"]["type"] != "service_unavailable_error":
    fail("owner down: %d %s" % (st, j))
subprocess.Popen([os.environ["BIN"] + "/moemesh-expert", "--router", os.environ["ROUTER"],
                  "--model", os.environ["MODEL"], "--owners", os.environ["OWNERS"],
                  "--heartbeat-ms", "100", "--listen", "ipc://%s/expert-1.ctl" % RUN,
                  "--instance", "1", "--data", os.environ["DATA_E1"], "--threads", "1"],
                 stderr=open(RUN + "/expert1b.log", "w"))
for _ in range(150):
    st, j, _ = post(C, {"prompt": "x", "max_tokens": 3})
    if st == 200:
        break
    time.sleep(0.1)
if st != 200:
    fail("not serving after the owner rejoined: %d %s" % (st, j))
print("PASS")
