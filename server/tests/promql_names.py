"""The metric names a PromQL expression reads, found by a tokenizer (not a parser).

Used by test_dashboards.py to check that every name the Grafana dashboard and the
alert rules use is one the server exports. Syntax is promtool's job (the same test
runs every expression through ``promtool check rules``); this only has to tell, token
by token, which identifiers are metric names.

What it does:

- skips string literals ("...", '...', `...`, with backslash escapes), comments (#),
  numbers (decimal, hex, exponents, Inf, NaN) and durations (5m, 1h30m);
- skips ranges and subqueries, ``[...]``, whatever they hold (durations, ``:``,
  Grafana's ``$__rate_interval``);
- inside label matchers, ``{...}``, reads no label name as a metric name, but takes
  ``__name__="x"`` and a bare quoted name (``{"x"}``, Prometheus 3) as the name x;
- reads keywords (aggregations, set and binary operators, ``bool``, ``offset``,
  ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right`` and the label
  list after them) case-insensitively, as PromQL does, and an identifier followed by
  ``(`` as a function;
- any other identifier is a metric name.

Limits, on purpose:

- Grafana variables (``$queue``, ``${queue}``, ``[[queue]]``) are not expanded; one
  standing where a metric name could (outside strings and brackets) is reported as an
  error rather than guessed, as is a regex or negative matcher on ``__name__``: the
  name such an expression reads is only known at query time.
- A keyword PromQL adds later would read as a metric name here, which makes the check
  fail (an unknown name), never pass wrongly.
- It does not know which names a recording rule defines: the rules here define none.
- ``label_values(expr, label)`` (Grafana's variable query) is unwrapped by
  :func:`names_in_grafana_query`; other Grafana query functions are refused.
"""

from __future__ import annotations

import re

AGGREGATIONS = frozenset(
    "sum avg count min max group stddev stdvar topk bottomk count_values quantile limitk limit_ratio".split()
)
KEYWORDS = frozenset("and or unless bool offset atan2 start end".split()) | AGGREGATIONS
# Followed by a parenthesised list of label names (optional for the group modifiers).
LABEL_LIST = frozenset("by without on ignoring group_left group_right".split())

_SPACE = re.compile(r"\s+")
_COMMENT = re.compile(r"#[^\n]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', re.S)
_DURATION = re.compile(r"(?:\d+(?:ms|s|m|h|d|w|y))+(?![\w.])")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+(?::\w+)?\]\]")
_MATCHER = re.compile(
    r'\s*(?:(?P<label>[a-zA-Z_]\w*)\s*(?P<op>=~|!~|!=|=)\s*(?P<value>"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`)'
    r'|(?P<name>"(?:[^"\\]|\\.)*"))\s*(?:,|$)',
    re.S,
)


class PromQLNameError(ValueError):
    """The expression's metric names cannot be told without running it."""


def _unquote(literal: str) -> str:
    if literal.startswith("`"):
        return literal[1:-1]
    return bytes(literal[1:-1], "utf-8").decode("unicode_escape")


def _closing(text: str, start: int, opening: str, closing: str) -> int:
    """The index just past the bracket that closes the one at ``start``, strings skipped."""
    depth, i = 0, start
    while i < len(text):
        string = _STRING.match(text, i)
        if string:
            i = string.end()
            continue
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise PromQLNameError(f"unclosed {opening!r} at {start} in {text!r}")


def _matcher_names(body: str, expr: str) -> set[str]:
    names: set[str] = set()
    pos, body = 0, body.strip()
    while pos < len(body):
        m = _MATCHER.match(body, pos)
        if not m or m.end() == pos:
            raise PromQLNameError(f"cannot read the label matchers {{{body}}} of {expr!r}")
        if m.group("name"):
            names.add(_unquote(m.group("name")))
        elif m.group("label") == "__name__":
            if m.group("op") != "=":
                raise PromQLNameError(f"a {m.group('op')} matcher on __name__ in {expr!r}: its names are known only at query time")
            names.add(_unquote(m.group("value")))
        pos = m.end()
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads (see the module's docstring for the limits)."""
    names: set[str] = set()
    i = 0
    while i < len(expr):
        for skip in (_SPACE, _COMMENT, _STRING, _DURATION, _NUMBER):
            m = skip.match(expr, i)
            if m and m.end() > i:
                i = m.end()
                break
        else:
            char = expr[i]
            variable = _VARIABLE.match(expr, i)
            if variable:
                raise PromQLNameError(f"Grafana variable {variable.group()} outside a string or range in {expr!r}")
            if char == "[":
                i = _closing(expr, i, "[", "]")
            elif char == "{":
                end = _closing(expr, i, "{", "}")
                names |= _matcher_names(expr[i + 1 : end - 1], expr)
                i = end
            elif ident := _IDENT.match(expr, i):
                word = ident.group()
                i = ident.end()
                rest = expr[i:].lstrip()
                lower = word.lower()
                if lower in LABEL_LIST:
                    if rest.startswith("("):
                        i = _closing(expr, expr.index("(", i), "(", ")")
                elif lower in KEYWORDS or lower in ("inf", "nan") or rest.startswith("("):
                    pass  # a keyword, a number's name, or a function
                else:
                    names.add(word)
            else:
                i += 1  # an operator, a parenthesis, a comma
    return names


_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<args>.*)\)\s*$", re.S)


def names_in_grafana_query(query: str) -> set[str]:
    """The metric names of a Grafana Prometheus variable query: ``label_values(label)``
    (none), ``label_values(expr, label)`` (those of expr), or a PromQL expression."""
    m = _LABEL_VALUES.match(query)
    if not m:
        if re.match(r"^\s*(label_names|metrics|query_result)\(", query):
            raise PromQLNameError(f"unsupported Grafana query {query!r}")
        return metric_names(query)
    args = m.group("args")
    depth = 0
    for at in range(len(args) - 1, -1, -1):  # the last comma outside brackets and strings
        char = args[at]
        if char in ")}]":
            depth += 1
        elif char in "({[":
            depth -= 1
        elif char == "," and depth == 0:
            return metric_names(args[:at])
    return set()  # label_values(label): a label, no metric
