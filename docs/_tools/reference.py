"""The generated parts of the reference: the CLI from `diffattn.cli.main`'s own parsers, and the config fields
from the dataclasses (their types, their defaults, and the comment beside each field in the source). Imported by
hooks.py at build time; nothing here is written twice."""

from __future__ import annotations

import argparse
import dataclasses
import html
import inspect
import io
import os
import tokenize
from pathlib import Path


def _cell(text: str) -> str:
    """A Markdown table cell: one line, pipes escaped, HTML shown as text."""
    return html.escape(" ".join(str(text).split())).replace("|", "\\|")


def _code_cell(text: str) -> str:
    return "<code>" + _cell(text) + "</code>" if text else ""


# --------------------------------------------------------------------------------------------------------- CLI
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("diffattn's parser has no commands")


def _option_rows(parser: argparse.ArgumentParser) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(group title, [(option, value, help)]) in the order --help shows them; the help as --help prints it
    (defaults appended by the command's formatter, %-expanded)."""
    formatter = parser._get_formatter()
    groups = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(action.option_strings) or action.metavar or action.dest
            value = ""
            if action.option_strings and action.nargs != 0:
                value = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
            elif not action.option_strings:
                value = ""
            rows.append((names, value, formatter._expand_help(action) if action.help else ""))
        if rows:
            groups.append((group.title or "options", rows))
    return groups


def cli_markdown() -> str:
    """Every command of `diffattn`, from the parsers `diffattn COMMAND --help` prints."""
    os.environ["COLUMNS"] = "100"  # usage lines wrapped as on a 100-column terminal, the same on every machine
    from diffattn.cli.main import COMMANDS, build_parser

    parser = build_parser()
    commands = _subparsers(parser)
    out = ["## `diffattn`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name in COMMANDS:
        sub = commands[name]
        out += [f"## `diffattn {name}` {{ #{name} }}", "", _escape_md(sub.description or ""), "",
                "```text", sub.format_usage().rstrip(), "```", ""]
        for title, rows in _option_rows(sub):
            out += [f"**{title[0].upper() + title[1:]}**", "", "| option | value | what it does |", "|---|---|---|"]
            out += [f"| {_code_cell(n)} | {_code_cell(v)} | {_cell(h)} |" for n, v, h in rows]
            out.append("")
        if sub.epilog:
            out += ["```text", sub.epilog.strip(), "```", ""]
    return "\n".join(out)


def _escape_md(text: str) -> str:
    return html.escape(text, quote=False)


# ------------------------------------------------------------------------------------------------ config fields
def _field_comments(cls: type) -> dict[str, str]:
    """{field: its comment in the source}: the comment lines right above the field and the one after it."""
    source_file = inspect.getsourcefile(cls)
    lines = Path(source_file).read_text(encoding="utf-8").splitlines()
    inline: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if tok.type == tokenize.COMMENT:
            inline[tok.start[0]] = tok.string.lstrip("#").strip()
    _, first = inspect.getsourcelines(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, str] = {}
    for i in range(first, first + len(inspect.getsourcelines(cls)[0])):
        text = lines[i - 1].strip()
        name = text.split(":", 1)[0].strip()
        if name not in names or text.startswith("#") or name in found:
            continue
        above, j = [], i - 1
        while j >= first and lines[j - 1].strip().startswith("#"):
            above.insert(0, lines[j - 1].strip().lstrip("#").strip())
            j -= 1
        after = inline.get(i, "") if not lines[i - 1].strip().startswith("#") else ""
        found[name] = " ".join(p for p in (" ".join(above), after) if p)
    return found


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "(required)"


def fields_table(cls: type, prefix: str) -> list[str]:
    comments = _field_comments(cls)
    rows = ["| field | type | default | what it is |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        rows.append(f"| {_code_cell(prefix + f.name)} | {_code_cell(str(f.type))} | {_code_cell(_default(f))} "
                    f"| {_cell(comments.get(f.name, ''))} |")
    return rows


def config_markdown() -> str:
    """The run config's sections and every attention type's options, from the dataclasses themselves."""
    from diffattn.attention.registry import ATTENTION
    from diffattn.configs.run_config import SECTIONS

    out: list[str] = []
    for section, cls in SECTIONS.items():
        doc = cls.__doc__ or ""
        if doc.startswith(cls.__name__ + "("):  # dataclasses' own stand-in for a missing docstring
            doc = ""
        first = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
        out += [f"## `[{section}]`: `{cls.__name__}` {{ #{section} }}", "",
                f"Defined in `{cls.__module__}`. {_escape_md(first)}", ""]
        out += fields_table(cls, f"{section}.") + [""]
    out += ["## Attention options (`[model.attn_options]`) { #attn-options }", "",
            "Each attention type declares its own typed options (its `Options` dataclass, in its file under "
            "`attention/`); `--model.attn_options.NAME VALUE` or `[model.attn_options]` in TOML sets them.", ""]
    for name, cls in sorted(ATTENTION.items()):
        opts = cls.Options
        if opts is None or not dataclasses.fields(opts):
            out += [f"### `{name}`", "", f"`{cls.__name__}` has no options of its own.", ""]
            continue
        out += [f"### `{name}`", "", f"`{cls.__name__}.Options` = `{opts.__name__}`.", ""]
        out += fields_table(opts, "") + [""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ API listings
def attention_api_markdown() -> str:
    """mkdocstrings directives for every registered attention class, read from the registry (a new variant's
    file is documented with no edit here)."""
    from diffattn.attention.registry import ATTENTION

    out = []
    for name, cls in sorted(ATTENTION.items()):
        out += [f"## `{name}`", "", f"::: {cls.__module__}.{cls.__qualname__}", "    options:",
                "      show_root_heading: true", "      heading_level: 3", "      members: [from_config, forward]", ""]
    return "\n".join(out)


def functional_api_markdown() -> str:
    """mkdocstrings directives for `diffattn.functional`: each registered type's ops (its `functional_ops`), where
    they are defined, then the shared math."""
    from diffattn.attention.functional import SHARED
    from diffattn.attention.registry import ATTENTION

    out, seen = [], set()
    for name, cls in sorted(ATTENTION.items()):
        fns = [fn for fn in cls.functional_ops if fn.__name__ not in seen]
        if not fns:
            continue
        out += [f"## `{name}`", ""]
        for fn in fns:
            seen.add(fn.__name__)
            out += [f"::: {fn.__module__}.{fn.__qualname__}", "    options:", "      heading_level: 3", ""]
    out += ["## Shared math", ""]
    for name, obj in sorted(SHARED.items()):
        if not getattr(obj, "__module__", "").startswith("diffattn"):
            continue  # a type alias (ScoreMod): named in the signatures that use it
        path = f"{obj.__module__}.{getattr(obj, '__qualname__', name)}"
        out += [f"::: {path}", "    options:", "      heading_level: 3", ""]
    return "\n".join(out)
