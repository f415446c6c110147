"""vllm-router's command line on `pdgate router`: its flags, mapped to pdgate's settings.

A team moving from vllm-router (its docs/cli_reference.md, Rust binary and Python launcher)
keeps its command line. Each of its flags is one `VllmFlag` row here, and each row is one
of four kinds:

- `same`: pdgate has the flag under the same name (vllm-router's value syntax accepted).
- `mapped`: the value sets pdgate's setting(s), converted to pdgate's units.
- `ignored`: accepted with a warning on stderr; it tunes something pdgate does not have.
- `refused`: a feature pdgate lacks, whose silent absence would change behaviour: the
  router exits 2 naming the flag.

The rows are the one source of the migration page's flag table
(docs/migrating-from-vllm-router.md, rewritten by `python -m pdgate.router.cli_vllm`; a
test compares both and checks them against vllm-router's documented flags and pdgate's
parser). The flags that are not pdgate's own are hidden from `--help`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pdgate.router.config import ConfigError

__all__ = ["VLLM_FLAGS", "VllmFlag", "add_vllm_router_flags", "migration_table",
           "prefill_urls", "vllm_router_overrides",
           "write_migration_page"]

Kind = Literal["same", "mapped", "ignored", "refused"]
Convert = Callable[[Any], dict[str, Any]]
_DISABLED_BREAKER = 2**31 - 1  # consecutive errors: never reached


@dataclass(frozen=True)
class VllmFlag:
    """One vllm-router flag: its `kind`, how many values it takes (`nargs`: 0 for a switch,
    1, or "*"), the pdgate flags it sets, `convert` (value -> config overrides, for
    `mapped` rows) and a note for the migration table."""

    flag: str
    kind: Kind
    pdgate: str | tuple[str, ...] = ()
    note: str = ""
    nargs: int | str = 1
    convert: Convert | None = None
    accepts: tuple[str, ...] = ()  # values that make a `refused` flag harmless

    @property
    def dest(self) -> str:
        return "vllm_" + self.flag.lstrip("-").replace("-", "_")

    @property
    def targets(self) -> tuple[str, ...]:
        """pdgate command-line snippets, each starting with one of pdgate's flags."""
        return (self.pdgate,) if isinstance(self.pdgate, str) else self.pdgate


def _to(*fields: str, scale: float | None = None, cast: type = int) -> Convert:
    def convert(value: Any) -> dict[str, Any]:
        number = float(value) * scale if scale is not None else cast(value)
        return {field: number for field in fields}
    return convert


def _const(**values: Any) -> Convert:
    return lambda _value: dict(values)


def _secs(*fields: str) -> Convert:
    return _to(*fields, cast=float)


_F = VllmFlag
VLLM_FLAGS: tuple[VllmFlag, ...] = (
    _F("--host", "same", "--host"),
    _F("--port", "same", "--port", "default 8000 (vllm-router: 30000)"),
    _F("--help", "same", "--help"),
    _F("--version", "same", "--version"),
    _F("--max-payload-size", "mapped", "--max-body-bytes", "bytes; default 4 MiB "
       "(vllm-router: 512 MiB)", convert=_to("max_body_bytes")),
    _F("--request-timeout-secs", "mapped",
       ("--prefill-timeout-s", "--decode-first-byte-timeout-s"),
       "seconds; streams are bounded by --decode-idle-timeout-s between chunks instead of "
       "a whole-request limit",
       convert=_secs("prefill_timeout_s", "decode_first_byte_timeout_s")),
    _F("--max-concurrent-requests", "same", "--max-concurrent-requests",
       "a hard limit of requests in flight (vllm-router: a token bucket's capacity)"),
    _F("--queue-size", "mapped", "--max-queued-requests",
       "requests waiting for a slot (0: no queue)",
       convert=_to("max_queued_requests")),
    _F("--queue-timeout-secs", "mapped", "--queue-timeout-s", "seconds",
       convert=_secs("queue_timeout_s")),
    _F("--rate-limit-tokens-per-second", "ignored", (),
       "admission counts requests in flight, it has no token bucket to refill"),
    _F("--cors-allowed-origins", "same", "--cors-allowed-origins",
       "without it pdgate sends no CORS headers (vllm-router allows any origin); "
       "`*` allows any"),
    _F("--worker-urls", "refused", ("--prefill", "--decode"),
       "pdgate always disaggregates: give prefill and decode engines", nargs="*"),
    _F("--worker-startup-timeout-secs", "mapped", "--startup-wait-s",
       "seconds a request waits for the first healthy engines",
       convert=_secs("startup_wait_s")),
    _F("--worker-startup-check-interval", "ignored", (),
       "engines are probed every 0.2 s until first ready, then every --health-interval-s"),
    _F("--intra-node-data-parallel-size", "mapped", ("--prefill-dp-size", "--decode-dp-size"),
       "DP ranks behind each engine URL, each routed to as an engine of its own (legs "
       "pinned with X-data-parallel-rank)", convert=_to("prefill_dp_size", "decode_dp_size")),
    _F("--backend", "refused", (), "vLLM engines only", accepts=("vllm",)),
    _F("--runtime", "refused", (), "vLLM engines only", accepts=("vllm",)),
    _F("--mini-lb", "refused", (), "no Python debug load balancer", nargs=0),
    _F("--enable-igw", "refused", (), "one model per router (no gateway mode)", nargs=0),
    _F("--history-backend", "ignored", (), "no gateway mode, so no history to store"),
    _F("--profile", "refused", (), "no profiling calls to engines", nargs=0),
    _F("--policy", "mapped", ("--prefill-policy", "--decode-policy"),
       "both legs, unless set separately; `cache_aware` = `prefix-text`, `consistent_hash` "
       "= `consistent-hash`, `power_of_two`, `round_robin`, `random`",
       convert=lambda v: {"prefill_policy": v, "decode_policy": v}),
    _F("--prefill-policy", "same", "--prefill-policy", "vllm-router's policy names accepted"),
    _F("--decode-policy", "same", "--decode-policy", "vllm-router's policy names accepted"),
    _F("--cache-threshold", "ignored", (),
       "`prefix-text` weighs the matched fraction against load instead of a threshold"),
    _F("--balance-abs-threshold", "mapped", ("--prefill-policy", "--decode-policy"),
       "the `balance_abs_threshold` param of the legs using `cache_aware` (`prefix-text`)"),
    _F("--balance-rel-threshold", "mapped", ("--prefill-policy", "--decode-policy"),
       "the `balance_rel_threshold` param of the legs using `cache_aware` (`prefix-text`)"),
    _F("--eviction-interval", "ignored", (), "the prefix index evicts least recently used "
       "entries at once, bounded by --prefix-index-max-blocks"),
    _F("--eviction-interval-secs", "ignored", (), "as --eviction-interval"),
    _F("--max-tree-size", "ignored", (), "bounded by --prefix-index-max-blocks instead"),
    _F("--vllm-pd-disaggregation", "mapped", (), "accepted: prefill/decode is the default",
       nargs=0, convert=_const()),
    _F("--prefill", "same", "--prefill",
       "`URL [BOOTSTRAP_PORT|none]`: the port is ignored with a warning"),
    _F("--decode", "same", "--decode"),
    _F("--vllm-discovery-address", "refused", "--discovery k8s",
       "no ZMQ worker registration"),
    _F("--kv-connector", "refused", "--pd-mode", "NixlConnector is --pd-mode pull, the "
       "default; mooncake and moriio are not supported", accepts=("nixl",)),
    _F("--enable-program-scheduling", "refused", (), "no program-level scheduling", nargs=0),
    _F("--program-scheduling-config-json", "refused", (), "no program-level scheduling"),
    _F("--service-discovery", "mapped", "--discovery k8s", "", nargs=0,
       convert=_const(discovery="k8s")),
    _F("--selector", "refused", ("--prefill-selector", "--decode-selector"),
       "no regular (non-disaggregated) workers", nargs="*"),
    _F("--service-discovery-port", "mapped", ("--prefill-port", "--decode-port"), "",
       convert=_to("prefill_port", "decode_port")),
    _F("--service-discovery-namespace", "mapped", "--namespace",
       "unset: the router pod's own namespace (vllm-router: all namespaces)",
       convert=lambda v: {"namespace": v}),
    _F("--prefill-selector", "same", "--prefill-selector", "space- or comma-separated"),
    _F("--decode-selector", "same", "--decode-selector", "space- or comma-separated"),
    _F("--retry-max-retries", "mapped", "--max-retries", "attempts on other engines",
       convert=_to("max_retries")),
    _F("--retry-initial-backoff-ms", "mapped", "--retry-backoff-s",
       "milliseconds to seconds", convert=_to("retry_backoff_s", scale=0.001)),
    _F("--retry-max-backoff-ms", "ignored", (), "pdgate retries before the first byte only, "
       "a few times: no cap needed"),
    _F("--retry-backoff-multiplier", "ignored", (), "the backoff doubles"),
    _F("--retry-jitter-factor", "ignored", (), "the backoff is fully jittered"),
    _F("--disable-retries", "mapped", "--max-retries 0", "", nargs=0,
       convert=_const(max_retries=0)),
    _F("--cb-failure-threshold", "mapped", "--eject-consecutive-errors", "",
       convert=_to("eject_consecutive_errors")),
    _F("--cb-success-threshold", "ignored", (),
       "one successful trial request closes the breaker"),
    _F("--cb-timeout-duration-secs", "mapped", "--breaker-open-s", "seconds",
       convert=_secs("breaker_open_s")),
    _F("--cb-window-duration-secs", "ignored", (), "unused by vllm-router too"),
    _F("--disable-circuit-breaker", "mapped", "--eject-consecutive-errors",
       f"set to {_DISABLED_BREAKER}: the breaker never opens", nargs=0,
       convert=_const(eject_consecutive_errors=_DISABLED_BREAKER)),
    _F("--health-failure-threshold", "same", "--health-failure-threshold"),
    _F("--health-success-threshold", "same", "--health-success-threshold"),
    _F("--health-check-timeout-secs", "mapped", "--health-timeout-s", "seconds",
       convert=_secs("health_timeout_s")),
    _F("--health-check-interval-secs", "mapped", "--health-interval-s", "seconds",
       convert=_secs("health_interval_s")),
    _F("--health-check-endpoint", "refused", (), "engines are probed at /health",
       accepts=("/health",)),
    _F("--log-dir", "ignored", (), "logs go to stderr (one JSON object per line with "
       "--log-format json)"),
    _F("--log-level", "same", "--log-level", "`warn` = `warning`"),
    _F("--prometheus-port", "ignored", (), "metrics are served at /metrics on --port"),
    _F("--prometheus-host", "ignored", (), "metrics are served at /metrics on --port"),
    _F("--request-id-headers", "same", "--request-id-headers",
       "the first header present wins; default: the four vllm-router reads"),
    _F("--enable-trace", "ignored", (), "tracing is on when --otlp-traces-endpoint or "
       "OTEL_EXPORTER_OTLP_ENDPOINT is set", nargs=0),
    _F("--otlp-traces-endpoint", "same", "--otlp-traces-endpoint", "an OTLP URL"),
    _F("--otel-sampling-ratio", "ignored", (), "use OTEL_TRACES_SAMPLER(_ARG)"),
    _F("--otel-excluded-paths", "ignored", (), "/health, /ready and /metrics are never "
       "traced", nargs="*"),
    _F("--api-key", "same", ("--api-key", "--engine-api-key"), "**different meaning**: "
       "pdgate's "
       "--api-key is the key clients must send; the key sent to engines (vllm-router's "
       "--api-key) is --engine-api-key"),
    _F("--api-key-validation-urls", "refused", ("--api-key", "--api-keys"),
       "keys are checked locally", nargs="*"),
    _F("--wasm-middleware", "refused", (), "no WASM middleware"),
    _F("--wasm-middleware-sha256", "refused", (), "no WASM middleware"),
    _F("--wasm-middleware-route", "refused", (), "no WASM middleware"),
)
"""vllm-router's flags (Rust binary and Python launcher), in its reference's order."""

_HIDDEN = tuple(f for f in VLLM_FLAGS if f.kind != "same")


def add_vllm_router_flags(parser: argparse.ArgumentParser) -> None:
    """Add vllm-router's own spellings to `parser`, hidden from `--help`."""
    for row in _HIDDEN:
        if row.nargs == 0:
            parser.add_argument(row.flag, dest=row.dest, action="store_true",
                                help=argparse.SUPPRESS)
        elif row.nargs == "*":
            parser.add_argument(row.flag, dest=row.dest, action="extend", nargs="*",
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(row.flag, dest=row.dest, help=argparse.SUPPRESS)


def vllm_router_overrides(args: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`args` (parsed flags) with vllm-router's flags turned into pdgate settings, and the
    warnings to show. pdgate's own flags win over the vllm-router flag setting the same
    field. Raises `ConfigError` for a refused flag or a bad value."""
    out = {k: v for k, v in args.items() if not k.startswith("vllm_")}
    warnings: list[str] = []
    mapped: dict[str, Any] = {}
    for row in _HIDDEN:
        if row.dest not in args:
            continue
        value = args[row.dest]
        if row.kind == "refused" and str(value) not in row.accepts:
            raise ConfigError(f"{row.flag} (vllm-router) is not supported: {row.note}")
        if row.kind == "ignored":
            warnings.append(f"{row.flag} (vllm-router) is ignored: {row.note}")
        if row.convert is not None:
            try:
                mapped.update(row.convert(value))
            except ValueError:
                raise ConfigError(f"{row.flag}: {value!r} is not a number") from None
    for field, value in mapped.items():
        out.setdefault(field, value)
    _balance_params(args, out, warnings)
    if "vllm_vllm_pd_disaggregation" in args and "api_key" in args:
        warnings.append("--api-key is the key clients must send to pdgate; the key sent "
                        "to engines (vllm-router's --api-key) is --engine-api-key")
    return out, warnings


def _balance_params(args: dict[str, Any], out: dict[str, Any], warnings: list[str]) -> None:
    params = {}
    for name in ("balance_abs_threshold", "balance_rel_threshold"):
        if (value := args.get("vllm_" + name)) is not None:
            try:
                params[name] = int(value) if name.endswith("abs_threshold") else float(value)
            except ValueError:
                raise ConfigError(f"--{name.replace('_', '-')}: {value!r} is not a "
                                  "number") from None
    if not params:
        return
    legs = [f for f in ("prefill_policy", "decode_policy")
            if out.get(f) in ("cache_aware", "prefix-text")]
    for field in legs:
        out[field] = {"type": "prefix-text", "params": params}
    if not legs:
        warnings.append("--balance-abs/rel-threshold (vllm-router) are ignored: no leg "
                        "uses cache_aware")


def prefill_urls(groups: Sequence[Sequence[str]]) -> tuple[list[str], list[str]]:
    """The URLs of `--prefill URL [BOOTSTRAP_PORT|none]` occurrences, and warnings.
    vllm-router's bootstrap port serves its KV handshake; pdgate's flows need none, so a
    port is accepted and ignored."""
    urls, warnings = [], []
    for values in groups:
        port = values[1] if len(values) == 2 else "none"
        if len(values) > 2 or not (port == "none" or port.isdigit()):
            raise ConfigError(f"--prefill {' '.join(values)}: expected URL "
                              "[BOOTSTRAP_PORT|none] (repeat --prefill for each engine)")
        if port != "none":
            warnings.append(f"--prefill {values[0]} {port}: the bootstrap port is ignored "
                            "(pdgate's KV transfer needs none)")
        urls.append(values[0])
    return urls, warnings


def migration_table() -> str:
    """The flag table of docs/migrating-from-vllm-router.md (Markdown)."""
    what = {"same": "same flag", "mapped": "mapped", "ignored": "ignored, with a warning",
            "refused": "refused (exit 2)"}
    lines = ["| vllm-router flag | pdgate | what happens |", "|---|---|---|"]
    for row in VLLM_FLAGS:
        target = ", ".join(f"`{t}`" for t in row.targets) or "-"
        text = what[row.kind]
        if row.accepts:
            text += " unless " + " or ".join(f"`{a}`" for a in row.accepts)
        if row.note:
            text += f": {row.note}"
        lines.append(f"| `{row.flag}` | {target} | {text} |")
    return "\n".join(lines) + "\n"


_BEGIN, _END = "<!-- vllm-router-flags:begin -->", "<!-- vllm-router-flags:end -->"


def write_migration_page(path: str = "docs/migrating-from-vllm-router.md") -> None:
    """Replace the table between the page's markers with `migration_table()`
    (`python -m pdgate.router.cli_vllm`)."""
    from pathlib import Path

    page = Path(path)
    head, rest = page.read_text().split(_BEGIN, 1)
    tail = rest.split(_END, 1)[1]
    page.write_text(f"{head}{_BEGIN}\n{migration_table()}{_END}{tail}")


if __name__ == "__main__":
    write_migration_page()
