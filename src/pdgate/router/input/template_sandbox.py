"""The Jinja sandbox client-supplied chat templates render in, with a render budget.

`BoundedEnvironment` / `render_bounded`: a jinja2 `ImmutableSandboxedEnvironment` set up
like transformers' chat-template environment, whose hooks stop a render that runs past its
deadline or builds values larger than its budget. A thread cannot be killed, so the
template must stop itself: every loop iteration, call, attribute and item lookup,
`* + % **`, `~`, filter and output checks the budget. Client templates render in worker
processes on top of this (router/input/template_workers.py).
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from string import Formatter
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Context, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from pdgate.router.errors import InvalidRequest

__all__ = ["BoundedEnvironment", "render_bounded", "rendered_size"]

class _OverBudget(Exception):
    """Raised inside a render by the hooks; `render_bounded` turns it into a 400."""


# Work a render may do in total, as a multiple of its output budget: chars of every string
# it creates (8 per element of containers), so values kept in variables are bounded too.
_WORK_FACTOR = 4
_INT_BITS = 1 << 16  # big-int arithmetic costs time without producing output
_TOJSON_MAX_INDENT = 16


@dataclass(slots=True)
class _Budget:
    deadline: float
    timeout_s: float
    max_chars: int
    work_left: int

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"chat template took longer than {self.timeout_s:g} s")

    def fits(self, size: int) -> None:
        if size > self.max_chars:
            raise _OverBudget(f"chat template builds a value of over {self.max_chars} "
                              "characters")

    def charge(self, size: int) -> None:
        self.work_left -= size
        if self.work_left < 0:
            raise _OverBudget("chat template does too much work (it builds over "
                              f"{_WORK_FACTOR * self.max_chars} characters)")


def rendered_size(value: Any, cap: int) -> int:
    """About `len(str(value))` without building it; stops counting once past `cap`."""
    total, stack = 0, [value]
    while stack and total <= cap:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 4
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, Namespace):
            total += 16
            stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 2
        else:
            total += 8
    return total


def _size(value: Any, cap: int) -> int:
    """The length of a string, else its `rendered_size`."""
    return len(value) if isinstance(value, str) else rendered_size(value, cap)


def _cost(value: Any) -> int:
    """What creating `value` cost: its chars, or 8 per element for a container."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return 8 * len(value)
    return 0


# --- the environment ---------------------------------------------------------------------

class _ChatTags(Extension):
    """transformers' `{% generation %}` tag (rendered as its body), and the loop tick."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())

    def tick(self) -> str:
        # The sandbox's `call` hook checks the budget; this only has to be called.
        return ""


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator plus a budget call at the top of every loop iteration and a
    size check of `~` operands before they are joined."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        tick = nodes.Call(nodes.ExtensionAttribute(_ChatTags.identifier, "tick"), [], [],
                          None, None)
        node.body = [nodes.ExprStmt(tick, lineno=node.lineno), *node.body]
        super().visit_For(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            func_name = "markup_join"
        else:
            func_name = "str_join"
        self.write(f"{func_name}(environment.sized_parts((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(")))")


class _TemplateNamespace(Namespace):
    # As transformers: no underscore attributes, so nothing reaches CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    if indent is not None and not 0 <= indent <= _TOJSON_MAX_INDENT:
        raise _OverBudget(f"tojson indent must be in 0..{_TOJSON_MAX_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (trim_blocks, lstrip_blocks, loopcontrols,
    `{% generation %}`, its `tojson`, `raise_exception`, `strftime_now`, `dict`,
    `namespace`) whose hooks enforce the budget of the render in progress
    (`render_bounded`). Outside a render the hooks check nothing. Safe to share between
    threads: each render's budget lives in a context variable."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_ChatTags, loopcontrols], finalize=self._finalize)
        self.budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
            "chat_template_budget", default=None)
        self.filters = {name: self._bounded_filter(name, f)
                        for name, f in {**self.filters, "tojson": _tojson}.items()}
        self.globals.pop("lipsum", None)  # its output grows with its argument; unused
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)
        self.concat = self._bounded_concat  # type: ignore[method-assign]

    # Hooks the sandbox calls. Each checks the clock; those that create values check their
    # size first and charge them to the render's work budget.

    def getattr(self, obj: Any, attribute: str) -> Any:
        if (b := self.budget.get()) is not None:
            b.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: str | Any) -> Any:
        if (b := self.budget.get()) is not None:
            b.tick()
        return super().getitem(obj, argument)

    def call(__self, __context: Context, __obj: Any, *args: Any,  # noqa: N805
             **kwargs: Any) -> Any:
        b = __self.budget.get()
        if b is None:
            return super().call(__context, __obj, *args, **kwargs)
        b.tick()
        # str methods build new strings (widths, repeats, joins); the sandbox hands out
        # str.format as a wrapper whose __wrapped__ is the real method.
        method = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            _check_parameters(b, args, kwargs)
            _check_str_method(b, getattr(method, "__name__", ""), owner, args)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, str):
            b.fits(len(result))
            b.charge(len(result))
        return result

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        b = self.budget.get()
        if b is not None:
            b.tick()
            _check_binop(b, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if b is not None:
            b.charge(_cost(result))
        return result

    def sized_parts(self, parts: tuple[Any, ...]) -> tuple[Any, ...]:
        """Operands of `~`, checked before they are turned into strings and joined."""
        if (b := self.budget.get()) is not None:
            size = sum(_size(p, b.max_chars) for p in parts)
            b.fits(size)
            b.charge(size)
        return parts

    def _finalize(self, value: Any) -> Any:
        # Every `{{ expression }}`, before it becomes a string: a list holding one big
        # string many times is small in memory, but not once printed.
        if (b := self.budget.get()) is not None:
            size = _size(value, b.max_chars)
            b.fits(size)
            b.charge(size)
        return value

    def _bounded_concat(self, parts: Any) -> str:
        # Macro bodies, `{% set %}` blocks, `caller()`: a buffer of references joined once.
        parts = list(parts)
        if (b := self.budget.get()) is not None:
            b.tick()
            size = sum(len(p) for p in parts)
            b.fits(size)
            b.charge(size)
        return "".join(parts)

    def _bounded_filter(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        check = _FILTER_CHECKS.get(name)
        skip = 1 if hasattr(f, "jinja_pass_arg") else 0  # context/environment comes first

        def bounded(*args: Any, **kwargs: Any) -> Any:
            b = self.budget.get()
            if b is not None:
                b.tick()
                data = args[skip:]
                _check_parameters(b, data[1:], kwargs)  # not the filtered value itself
                if check is not None:
                    check(b, data, kwargs)
            result = f(*args, **kwargs)
            if b is not None:
                if isinstance(result, str):
                    b.fits(len(result))
                b.charge(_cost(result))
            return result

        bounded.__dict__.update(getattr(f, "__dict__", {}))  # jinja's pass_context & co.
        bounded.__name__ = name
        return bounded


_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?([#0 +\-]*[\d*]*(?:\.[\d*]+)?)[a-zA-Z%]")


def _check_parameters(b: _Budget, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # Widths, counts and repeats beyond the budget can only build something too big.
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > b.max_chars:
            raise _OverBudget(f"chat template argument {value} exceeds {b.max_chars}")


def _check_str_method(b: _Budget, name: str, s: str, args: tuple[Any, ...]) -> None:
    if name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else 8
        b.fits(len(s) + s.count("\t") * max(tab, 0))
    elif name == "replace" and len(args) >= 2:
        _check_replace(b, s, args[0], args[1])
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        b.fits(rendered_size(args[0], b.max_chars) + len(s) * len(args[0]))
    elif name in ("format", "format_map"):
        widths = sum(int(n) for _, _, spec, _ in Formatter().parse(s)
                     for n in _NUMBER.findall(spec or ""))
        b.fits(len(s) + widths + rendered_size(args, b.max_chars))


def _check_replace(b: _Budget, s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        hits = s.count(old) if old else len(s) + 1
        b.fits(len(s) + hits * max(len(new) - len(old), 0))


def _check_binop(b: _Budget, op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                b.fits(_size(seq, b.max_chars) * max(n, 0))
        if isinstance(left, int) and isinstance(right, int):
            _check_bits(left.bit_length() + right.bit_length())
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0:
            _check_bits(max(left.bit_length(), 1) * right)
    elif op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            b.fits(_size(left, b.max_chars) + _size(right, b.max_chars))
    elif op == "%" and isinstance(left, str):
        specs = _PERCENT_SPEC.findall(left)
        if any("*" in spec for spec in specs):
            raise _OverBudget("`*` widths in %-formatting are not supported")
        widths = sum(int(n) for spec in specs for n in _NUMBER.findall(spec))
        b.fits(len(left) + widths + rendered_size(right, b.max_chars))


def _check_bits(bits: int) -> None:
    if bits > _INT_BITS:
        raise _OverBudget(f"chat template integer arithmetic over {_INT_BITS} bits")


# Filters whose output can outgrow their input: checked before they run. `data` is the
# filtered value followed by the filter's arguments.

def _indent_check(b: _Budget, data: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    s = str(data[0]) if data else ""
    width = data[1] if len(data) > 1 else kwargs.get("width", 4)
    prefix = len(width) if isinstance(width, str) else max(int(width), 0)
    b.fits(len(s) + (s.count("\n") + 1) * prefix)


def _join_check(b: _Budget, data: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    seq = data[0] if data else None
    sep = data[1] if len(data) > 1 else kwargs.get("d", "")
    if isinstance(seq, (list, tuple)):
        b.fits(rendered_size(seq, b.max_chars) + len(str(sep)) * len(seq))


def _replace_check(b: _Budget, data: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if len(data) >= 3:
        _check_replace(b, data[0], data[1], data[2])


def _render_check(b: _Budget, data: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    indent = kwargs.get("indent", data[2] if len(data) > 2 else None)
    factor = 1 + (indent if isinstance(indent, int) and indent > 0 else 0)
    b.fits(rendered_size(data[0] if data else None, b.max_chars) * factor)


def _format_check(b: _Budget, data: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if data and isinstance(data[0], str):
        _check_binop(b, "%", data[0], data[1:] or kwargs)


_FILTER_CHECKS: dict[str, Callable[[_Budget, tuple[Any, ...], dict[str, Any]], None]] = {
    "indent": _indent_check, "join": _join_check, "replace": _replace_check,
    "format": _format_check, "tojson": _render_check, "string": _render_check,
    "pprint": _render_check, "xmlattr": _render_check, "urlencode": _render_check,
}


def render_bounded(env: BoundedEnvironment, template: Template | str,
                   variables: dict[str, Any], *, timeout_s: float, max_chars: int,
                   stop_after: int | None = None) -> str:
    """Render `template` (compiled by `env`, or source compiled here under the budget) in
    this thread, within `timeout_s` and `max_chars` of output.

    `stop_after`: stop once the output is longer than this many characters and return what
    was rendered so far (the caller only needs to know it is too long). Every failure — a
    template error, the budget, a lone surrogate in the output — is `InvalidRequest`.
    """
    budget = _Budget(time.monotonic() + timeout_s, timeout_s, max_chars,
                     _WORK_FACTOR * max_chars)
    token = env.budget.set(budget)
    try:
        if isinstance(template, str):
            template = env.from_string(template)
        text = "".join(_bounded_output(template, variables, budget, stop_after))
    except _OverBudget as exc:
        raise InvalidRequest(str(exc), param="messages") from None
    except RecursionError:
        raise InvalidRequest("chat template recursion too deep", param="messages") from None
    except MemoryError:
        raise  # not the template's error to report: the worker process answers it
    except Exception as exc:  # jinja/template errors carry the useful message
        raise InvalidRequest(f"cannot apply chat template: {exc}", param="messages") from None
    finally:
        env.budget.reset(token)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("chat template output is not valid Unicode (lone "
                                 "surrogate)", param="messages") from None
    return text


def _bounded_output(template: Template, variables: dict[str, Any], budget: _Budget,
                    stop_after: int | None) -> Iterator[str]:
    size = 0
    for piece in template.generate(variables):
        size += len(piece)
        if stop_after is not None and size > stop_after:
            # One char past the limit says "too long"; a 4 MB piece need not be copied.
            yield piece[:len(piece) - (size - stop_after) + 1]
            return
        budget.fits(size)
        budget.tick()
        yield piece
