"""``kvcache-op serve --replicas 2``: the same app as two Ray Serve replicas on loopback, each with its own engine;
requests spread over both (rounds of them until both have answered) and every answer is the model's own greedy
text; the server starts a Ray instance of its own, whose servers listen on loopback too."""

import concurrent.futures

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="the Ray Serve deployment needs the 'ray' extra: pip install '.[ray]'")
httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")  # kvcache_op.hf imports it
pytest.importorskip("transformers")

from conftest import SERVER_API_KEY  # noqa: E402
from listening_sockets import is_loopback, listening_sockets, self_check  # noqa: E402

from kvcache_op.hf.verify import reference_generate  # noqa: E402
from kvcache_op.listening import usable_cores  # noqa: E402
from kvcache_op.serve_command import ServerProcess  # noqa: E402

two_cores = pytest.mark.skipif(usable_cores() < 2, reason="two replicas need two cores (one replica per core)")


@two_cores
def test_two_replicas_answer_with_the_models_own_text(served_checkpoint, tmp_path):
    folder, model, tokenizer = served_checkpoint
    prompts = [f"hello world {i}" for i in range(16)]
    want = [tokenizer.decode(reference_generate(model, tokenizer(p)["input_ids"], 6), skip_special_tokens=True)
            for p in prompts]
    with ServerProcess(folder, "--replicas", 2, "--api-key", SERVER_API_KEY, "--cache-dir", tmp_path,
                       "--num-pages", 64, "--model-name", "tiny", lifetime=300, start_timeout=240,
                       # A cluster address in the environment is not joined: the server starts its own instance.
                       env={"RAY_ADDRESS": "127.0.0.1:9"}) as server:
        def ask(prompt):
            reply = httpx.post(server.url + "/v1/completions", timeout=120,
                               headers={"Authorization": f"Bearer {SERVER_API_KEY}"},
                               json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0})
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"], reply.headers["x-kvcache-op-engine"]
        engines = set()
        # Ray's router learns of the replicas on its own schedule: rounds of the same requests until both have
        # answered (a bounded number), each round's texts the model's own.
        for round_index in range(10):
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(ask, prompts))
            assert [text for text, _ in answers] == want
            engines |= {engine for _, engine in answers}
            if len(engines) == 2:
                break
        assert len(engines) == 2, "both replicas should have answered within 10 rounds of 16 requests"
        _assert_metrics_hold_every_replica(server, engines, answered=(round_index + 1) * len(prompts))
        _assert_listens_on_loopback(server)
        unauthorized = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=60)
        assert unauthorized.status_code == 401


def _assert_metrics_hold_every_replica(server, engines, answered):
    """Whichever replica Ray's router sends a scrape to, /metrics holds both replicas' series, each labelled with its
    replica and its engine (the x-kvcache-op-engine of its answers): the completions they count add up to those
    answered. Each replica leaves its series every second: a few scrapes until they are all in."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(40):
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=60).text)}
        completions = [s for s in families["kvcache_op_requests"].samples if s.name == "kvcache_op_requests_total"
                       and s.labels["route"] == "/v1/completions" and s.labels["status"] == "200"]
        if sum(s.value for s in completions) == answered:
            break
        time.sleep(0.5)
    assert sum(s.value for s in completions) == answered, completions
    assert {s.labels["engine"] for s in completions} == engines
    assert len({s.labels["replica"] for s in completions}) == 2
    assert [s.value for s in families["kvcache_op_replicas_reporting"].samples] == [2]
    running = families["kvcache_op_running_requests"].samples
    assert sorted(s.labels["engine"] for s in running) == sorted(engines)  # each replica's engine state, once


def _assert_listens_on_loopback(server):
    """Every socket the server's process tree listens on is loopback (Ray's GCS, raylet, agents and actors, and
    the proxy), except each Serve replica's inter-deployment gRPC port, which Ray Serve binds to ``[::]`` itself
    (behind Ray's cluster token; README, Replicas): the two engines' and the metrics hub's."""
    self_check()
    sockets = listening_sockets(server.process.pid)
    port = int(server.url.rsplit(":", 1)[1])
    assert any(p == port for *_, p in sockets), (port, sockets)  # the tree was read: the proxy is in it
    exposed = [s for s in sockets if not is_loopback(s[2])]
    replicas_wildcard = [s for s in exposed if s[1].startswith("ray::ServeRepli") and s[2].is_unspecified]
    assert len({s[0] for s in replicas_wildcard}) == len(replicas_wildcard) <= 3, sockets
    assert exposed == replicas_wildcard, f"listening beyond loopback: {sorted(set(exposed) - set(replicas_wildcard))}"


@two_cores
def test_replicas_keep_the_servers_limits_and_end_their_requests_whole_at_a_stop(exported):
    """With --max-running 6 --max-queue 0 on each of two replicas, a burst beyond their 12 running slots gets the
    server's own 503 (Ray Serve's default of 5 requests per replica queued the rest in its router, unlimited, and
    ran fewer at once); then SIGTERM ends every request running as a single server's shutdown does: each reply
    whole (finish_reason "abort", a stream with its last chunk and [DONE]), exit status 0, the signal named in the
    last line."""
    import json
    import signal
    import threading
    import time

    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    outcomes, lock = [], threading.Lock()

    def plain(url):
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        with lock:
            outcomes.append(reply)

    def refused():
        with lock:
            return [r for r in outcomes if r.status_code == 503]

    # --decode-steps 1: a step per token, so that the requests outlast the burst's refusals and the stop's delivery
    with ServerProcess(exported, "--replicas", 2, "--max-running", 6, "--max-queue", 0, "--num-pages", 400,
                       "--max-tokens-limit", 1000, "--decode-steps", 1, "--model-name", "tiny", lifetime=300,
                       start_timeout=240) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
            lines = reply.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # running on one replica
            burst = [threading.Thread(target=plain, args=(server.url,)) for _ in range(20)]
            for t in burst:
                t.start()
            deadline = time.monotonic() + 60
            while len(refused()) < 21 - 12 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(refused()) >= 21 - 12, [r.status_code for r in outcomes]
            server.process.send_signal(signal.SIGTERM)
            tail = [line for line in lines if line.startswith("data: ")]
        code = server.wait(60)
        for t in burst:
            t.join(120)
    for reply in refused():
        assert reply.json()["error"]["type"] == "server_overloaded", reply.text
    answered = [r for r in outcomes if r.status_code != 503]
    assert all(r.status_code == 200 for r in answered), [(r.status_code, r.text[:200]) for r in answered]
    assert tail[-1] == "data: [DONE]", tail[-3:]
    reasons = [json.loads(tail[-2][6:])["choices"][0]["finish_reason"]]
    reasons += [r.json()["choices"][0]["finish_reason"] for r in answered]
    assert set(reasons) <= {"abort", "length"} and "abort" in reasons, reasons
    assert code == 0 and "SIGTERM received" not in server.output, server.output[-2000:]
    assert server.output.splitlines()[-1].startswith("stopped by SIGTERM after "), server.output[-500:]


def test_a_taken_port_is_refused_in_one_line_before_ray_starts(exported, capsys):
    import socket
    import time

    from kvcache_op.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        start = time.monotonic()
        code = main(["serve", str(exported), "--replicas", "1", "--port", str(taken.getsockname()[1])])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Address already in use" in err, err
    assert time.monotonic() - start < 30, "refused only after Ray had started"


_TAKEN_AFTER_THE_CHECK = """
import socket, sys
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen(1)
from kvcache_op import ray_command
ray_command.free_port = lambda host: taken.getsockname()[1]  # free when checked, taken when Ray Serve binds it
from kvcache_op.cli import main
print(taken.getsockname()[1], flush=True)
sys.exit(main(["serve", sys.argv[1], "--replicas", "1", "--port", "0"]))
"""


def test_a_port_taken_after_the_check_is_refused_in_one_line(exported):
    """--port 0 picks a free port and Ray Serve's proxy binds it seconds later: another process may take it in
    between. One line and status 2, not Ray's traceback of its proxy actor (in a process of its own: Ray must be
    imported after the server sets its environment)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _TAKEN_AFTER_THE_CHECK, str(exported)], capture_output=True,
                          text=True, timeout=300)
    port = done.stdout.split()[0]
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"kvcache-op serve: error: Ray Serve's proxy could not listen on http://127.0.0.1:{port}: the port was free "
        "when checked and another process took it since; start again (or pass another --port)"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_stop_while_ray_serve_starts_ends_the_start_with_status_0(exported):
    """SIGTERM once the replicas are being deployed (Ray's own handler exited with status 15 there): the start
    ends, the command's last line names the signal, exit status 0, no traceback."""
    import signal
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "kvcache_op", "serve", str(exported), "--replicas", "1",
                                "--port", "0", "--model-name", "tiny", "--stop-after", "300"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if "Ray Serve replicas" in line:  # printed just before the replicas are deployed
                process.send_signal(signal.SIGTERM)
                break
        lines += process.stdout.readlines()
        code = process.wait(120)
    finally:
        process.kill()
    output = "".join(lines)
    assert code == 0 and "Traceback" not in output and "SIGTERM received" not in output, output[-2000:]
    assert "listening on" not in output, output[-2000:]
    assert lines[-1].startswith("stopped by SIGTERM after "), output[-500:]


def test_an_engine_setting_a_replica_refuses_is_one_line(exported):
    """The engine's one-line refusal (here a step budget beyond the model's rotary tables) raised in a replica reaches
    the command as that line, status 2, not Ray Serve's "Failed to update the deployments" traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvcache_op", "serve", str(exported), "--replicas", "1", "--port", "0",
                           "--max-batch-tokens", "100000000", "--stop-after", "30"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvcache-op serve: error: a replica could not start: max_batch_tokens=100000000 is more "
                           "than the"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
