"""The Dockerfile, checked without a Docker engine: it is parsed here, and every file it
copies, every stage it names and every command line it starts is checked against the tree
and the real CLI parsers."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from packaging.requirements import Requirement

from pdgate.cli import SUBCOMMANDS
from pdgate.engine_shim.cli import build_parser as shim_parser
from pdgate.router.cli import build_parser as router_parser

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Instruction:
    keyword: str
    args: str
    heredoc: str | None = None  # body of a `<<EOF` heredoc, if any


@dataclass
class Stage:
    image: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile: continuation lines joined, comments
    dropped, heredoc bodies attached to their instruction."""
    lines = text.splitlines()
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        keyword, _, args = line.strip().partition(" ")
        instr = Instruction(keyword.upper(), args.strip())
        if m := re.search(r"<<-?'?\"?(\w+)", args):
            body: list[str] = []
            while lines[i].strip() != m.group(1):
                body.append(lines[i])
                i += 1
            i += 1
            instr.heredoc = "\n".join(body) + "\n"
        if instr.keyword == "FROM":
            image, *rest = instr.args.split()
            name = rest[1] if len(rest) == 2 and rest[0].upper() == "AS" else str(len(stages))
            stages.append(Stage(image, name))
        elif not stages:
            assert instr.keyword == "ARG", f"{instr.keyword} before the first FROM"
            key, _, default = instr.args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(instr)
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    args, stages = parse_dockerfile((ROOT / "Dockerfile").read_text())
    return args, {s.name: s for s in stages}


def exec_form(instr: Instruction) -> list[str]:
    value = json.loads(instr.args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), instr.args
    return value


def pins(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        name, sep, version = line.strip().partition("==")
        assert sep and version, f"not pinned with ==: {line!r}"
        out[name.lower().replace("_", "-")] = version
    return out


def heredoc(stage: Stage, dest_suffix: str) -> str:
    for instr in stage.all("COPY"):
        if instr.heredoc is not None and instr.args.split()[-1].endswith(dest_suffix):
            return instr.heredoc
    raise AssertionError(f"stage {stage.name} writes no {dest_suffix}")


def dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return path.split("/")[0] in patterns


def test_stages_and_pinned_base_images(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    args, stages = dockerfile
    assert {"router-build", "router", "shim"} <= set(stages)
    for stage in stages.values():
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage.image)
        assert image.startswith(("python:", "nvidia/cuda:")), image
        tag = image.split(":", 1)[1]
        assert re.search(r"\d+\.\d+\.\d+", tag) and "latest" not in tag, f"unpinned {image}"
    assert "cuda" in args[stages["shim"].image.strip("${}")]
    assert "slim" in args[stages["router"].image.strip("${}")]


def test_copy_sources_exist_and_are_in_the_build_context(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    _, stages = dockerfile
    names = list(stages)
    copies = 0
    for position, stage in enumerate(stages.values()):
        for instr in stage.all("COPY"):
            if instr.heredoc is not None:
                continue
            words = shlex.split(instr.args)
            flags = [w for w in words if w.startswith("--")]
            sources = [w for w in words if not w.startswith("--")][:-1]
            source_stage = next((f.split("=", 1)[1] for f in flags
                                 if f.startswith("--from=")), None)
            if source_stage is not None:
                assert source_stage in names[:position], f"COPY --from={source_stage}: no " \
                                                          "such earlier stage"
                made_there = "\n".join(
                    i.args + (i.heredoc or "") for i in stages[source_stage].instructions)
                for src in sources:
                    assert src in made_there, f"{src} is not created in {source_stage}"
                continue
            for src in sources:
                copies += 1
                assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
                assert not dockerignored(src), f"COPY {src}: excluded by .dockerignore"
    assert copies >= 8


def test_router_image_has_no_torch_nixl_or_shim(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    _, stages = dockerfile
    for name in ("router-build", "router"):
        stage = stages[name]
        text = "\n".join(i.args + (i.heredoc or "") for i in stage.instructions)
        assert "engine_shim" not in text.replace("no engine_shim", "")
        assert not re.search(r"\b(torch|nixl[-\w]*)==", text)
    final = stages["router"]
    assert all("--from=router-build" in i.args for i in final.all("COPY"))


@pytest.mark.parametrize("name", ["router", "shim"])
def test_images_run_as_non_root_with_a_healthcheck(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], name: str
) -> None:
    stage = dockerfile[1][name]
    user = stage.last("USER").args.split(":")[0]
    assert user not in ("root", "0")
    assert any(f"--uid {user}" in i.args for i in stage.all("RUN")), "user is never created"
    check = stage.last("HEALTHCHECK").args
    assert "CMD" in check and "--interval" in check


def entry_argv(stage: Stage) -> tuple[list[str], list[str]]:
    return exec_form(stage.last("ENTRYPOINT")), exec_form(stage.last("CMD"))


def console_scripts() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    scripts: dict[str, str] = project["scripts"]
    return scripts


def health_port(stage: Stage) -> int:
    env = " ".join(i.args for i in stage.all("ENV"))
    url = re.search(r"PDGATE_HEALTH_URL=(\S+)", env)
    assert url, "no PDGATE_HEALTH_URL"
    port = urlsplit(url.group(1)).port
    assert port is not None
    return port


def test_router_entrypoint_matches_the_cli(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    stage = dockerfile[1]["router"]
    entry, cmd = entry_argv(stage)
    assert entry == ["pdgate", "router"]
    assert console_scripts()["pdgate"] == "pdgate.cli:main" and "router" in SUBCOMMANDS
    args = router_parser().parse_args(cmd)  # exits (SystemExit) on an unknown flag
    assert args.host == "0.0.0.0"
    assert str(args.port) in stage.last("EXPOSE").args.split()
    assert health_port(stage) == args.port
    assert args.config == "/etc/pdgate/router.yaml"


def test_shim_entrypoint_matches_the_cli(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    stage = dockerfile[1]["shim"]
    entry, cmd = entry_argv(stage)
    assert entry == ["pdgate", "shim"] and "shim" in SUBCOMMANDS
    args = shim_parser().parse_args(cmd)
    assert args.host == "0.0.0.0" and args.device == "cuda"
    exposed = stage.last("EXPOSE").args.split()
    assert str(args.port) in exposed and str(args.side_channel_port) in exposed
    assert health_port(stage) == args.port


def test_pins_cover_and_satisfy_pyproject(
    dockerfile: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    _, stages = dockerfile
    router_pins = pins(heredoc(stages["router-build"], "constraints-router.txt"))
    shim_pins = pins(heredoc(stages["shim"], "constraints-shim.txt"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = req.name.lower().replace("_", "-")
        assert name in router_pins, f"{name} is not pinned for the router image"
        assert req.specifier.contains(router_pins[name]), f"{name}=={router_pins[name]} " \
                                                          f"violates {spec}"
    shim_extra = {Requirement(s).name: Requirement(s) for s in
                  project["optional-dependencies"]["shim"]}
    assert shim_pins["torch"] in shim_extra["torch"].specifier
    assert shim_pins["nixl-cu13"] in shim_extra["nixl-cu13"].specifier  # same NIXL release
    for name in ("safetensors", "numpy"):
        assert shim_extra[name].specifier.contains(shim_pins[name])
    torch_runs = [i.args for i in stages["shim"].all("RUN") if "torch==" in i.args]
    assert torch_runs and f"torch=={shim_pins['torch']}" in torch_runs[0]


@pytest.mark.parametrize("stage_name", ["router-build", "shim"])
def test_both_images_install_the_otel_extra_pinned(
    dockerfile: tuple[dict[str, str], dict[str, Stage]], stage_name: str,
) -> None:
    """Tracing is switched on by configuration alone (both OTLP exporters in the image)."""
    _, stages = dockerfile
    installs = [i.args for i in stages[stage_name].all("RUN") if "pip install" in i.args]
    assert any(re.search(r"'\.\[[\w,]*\botel\b", args) for args in installs), installs
    router_pins = pins(heredoc(stages["router-build"], "constraints-router.txt"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    otel = [Requirement(s) for s in project["optional-dependencies"]["otel"]]
    assert {r.name for r in otel} >= {"opentelemetry-exporter-otlp-proto-http",
                                      "opentelemetry-exporter-otlp-proto-grpc"}
    for req in otel:
        assert req.name in router_pins, f"{req.name} is not pinned"
        assert req.specifier.contains(router_pins[req.name]), req
