"""Run a rendered pod's container as a local process: its args and env exactly as Kubernetes
would hand them over, with the volumes it mounts materialized under a scratch directory.

What Kubernetes does and this copies: env entries in order, `$(VAR)` expanded from the
entries above (unknown references stay as written, `$$` escapes), `fieldRef` from the pod
(`status.podIP`, `metadata.name`, `metadata.namespace`), `secretKeyRef` / `configMapKeyRef`
from the rendered Secret / ConfigMap manifests (a missing non-optional one fails, as the pod
would not start), then `$(VAR)` in args. Mounted configMap, secret and projected volumes
become files (with their `defaultMode`), emptyDir and other volumes empty directories; every
arg or env value that names a path under a mount is moved under the scratch directory.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.helm_render import Rendered

_REF = re.compile(r"\$\$|\$\((\w+)\)")


def secret_value(r: Rendered, name: str, key: str) -> str | None:
    """A key of a rendered Secret, decoded (None when the Secret or the key is absent)."""
    for s in r.of("Secret"):
        if s["metadata"]["name"] == name:
            if key in s.get("data", {}):
                return base64.b64decode(s["data"][key]).decode()
            value: str | None = s.get("stringData", {}).get(key)
            return value
    return None


def _config_value(r: Rendered, name: str, key: str) -> str | None:
    for cm in r.of("ConfigMap"):
        if cm["metadata"]["name"] == name:
            value: str | None = cm.get("data", {}).get(key)
            return value
    return None


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion (dependent env vars, container args)."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(one, text)


@dataclass
class Container:
    """One container of a rendered Deployment, made runnable here."""

    name: str
    args: list[str]
    env: dict[str, str]
    ports: dict[str, int]
    probes: dict[str, dict[str, Any]]  # readinessProbe / livenessProbe / startupProbe
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> local directory

    def process_env(self) -> dict[str, str]:
        """This machine's environment without any PDGATE_ / VLLM_ setting, plus the pod's."""
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("PDGATE_", "VLLM_"))}
        return {**base, **self.env}


def realize(r: Rendered, dep: dict[str, Any], root: Path, *, pod_ip: str = "127.0.0.1",
            namespace: str = "llm", container: int = 0) -> Container:
    """Materialize `dep`'s pod under `root` and resolve one container's args and env."""
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][container]
    pod_name = dep["metadata"]["name"] + "-0"
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for m in c.get("volumeMounts", []):
        local = root / m["mountPath"].lstrip("/")
        _materialize(r, volumes[m["name"]], local)
        mounts[m["mountPath"]] = local

    def localize(value: str) -> str:
        for path in sorted(mounts, key=len, reverse=True):
            if value == path or value.startswith(path.rstrip("/") + "/"):
                return str(mounts[path]) + value[len(path):]
        return value

    fields = {"status.podIP": pod_ip, "metadata.name": pod_name,
              "metadata.namespace": namespace}
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = localize(expand(str(e["value"]), env))
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            value: str | None = fields[src["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in src or "configMapKeyRef" in src:
            is_secret = "secretKeyRef" in src
            ref = src["secretKeyRef" if is_secret else "configMapKeyRef"]
            get = secret_value if is_secret else _config_value
            value = get(r, ref["name"], ref["key"])
            if value is None:
                assert ref.get("optional"), f"{e['name']}: {ref} does not exist"
                continue
        else:
            raise NotImplementedError(f"{e['name']}: {src}")
        assert value is not None
        env[e["name"]] = value
    args = [localize(expand(a, env)) for a in [*c.get("command", []), *c.get("args", [])]]
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    probes = {k: c[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in c}
    return Container(c["name"], args, env, ports, probes, mounts)


def _materialize(r: Rendered, volume: dict[str, Any], local: Path) -> None:
    local.mkdir(parents=True, exist_ok=True)
    files: list[tuple[str, str]] = []
    mode = 0o644
    if "configMap" in volume:
        files = _items(r, volume["configMap"], False)
        mode = volume["configMap"].get("defaultMode", mode)
    elif "secret" in volume:
        files = _items(r, {**volume["secret"], "name": volume["secret"]["secretName"]}, True)
        mode = volume["secret"].get("defaultMode", mode)
    elif "projected" in volume:
        mode = volume["projected"].get("defaultMode", mode)
        for src in volume["projected"]["sources"]:
            if "secret" in src:
                files += _items(r, src["secret"], True)
            elif "configMap" in src:
                files += _items(r, src["configMap"], False)
            else:
                raise NotImplementedError(f"projected source {src}")
    for path, text in files:
        target = local / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(mode | 0o400)  # the test process reads them as their owner


def _items(r: Rendered, src: dict[str, Any], is_secret: bool) -> list[tuple[str, str]]:
    """(path, content) of a configMap/secret volume source; a missing object or key fails
    unless the source is optional, as the kubelet would."""
    name = src["name"]
    if is_secret:
        objs = [s for s in r.of("Secret") if s["metadata"]["name"] == name]
        data = {k: base64.b64decode(v).decode() for k, v in
                (objs[0].get("data", {}) if objs else {}).items()}
    else:
        objs = [c for c in r.of("ConfigMap") if c["metadata"]["name"] == name]
        data = dict(objs[0].get("data", {})) if objs else {}
    if not objs:
        assert src.get("optional"), f"volume source {name} does not exist"
        return []
    items = src.get("items") or [{"key": k, "path": k} for k in data]
    out = []
    for item in items:
        if item["key"] not in data:
            assert src.get("optional"), f"{name} has no key {item['key']}"
            continue
        out.append((item["path"], data[item["key"]]))
    return out
