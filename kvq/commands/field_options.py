"""Command-line options declared by a settings dataclass (`EngineConfig`, `ServerConfig`): every field made
with `kvq.runtime.config.option` (a help text in its metadata) is an option `--field-name`, with the field's
default, so a command declares none of them by hand. Imports typer/click and kvq.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import typer

from kvq.runtime.config import option_names

F = TypeVar("F", bound=Callable[..., Any])
_KEYWORD = inspect.Parameter.KEYWORD_ONLY
_GIVEN = ("COMMANDLINE", "ENVIRONMENT")  # click's ParameterSource names (typer ships its own click)


@dataclass(frozen=True)
class GivenOptions:
    """A command's options from one dataclass: `values` every one (default or given), `given` those that came
    from the command line or an environment variable (what overrides a --config file's settings)."""

    values: dict[str, Any]
    given: dict[str, Any]

    def over(self, from_file: Mapping[str, Any]) -> dict[str, Any]:
        """A config file's settings with the options given on top (a default never overrides the file)."""
        return {**from_file, **self.given}


def field_options(
    settings: type, param: str, names: tuple[str, ...] = (), help: Mapping[str, str] | None = None
) -> Callable[[F], F]:
    """Decorate a typer command: the options `names` (fields of `settings`; default: every field with a help
    text) take the place of its parameter `param`, which receives them as `GivenOptions`. `help` replaces a
    field's help text for this command."""
    hints = typing.get_type_hints(settings)
    fields = {f.name: f for f in dataclasses.fields(settings)}
    names = names or option_names(settings)
    for name in names:
        if "help" not in fields.get(name, dataclasses.field()).metadata:
            raise ValueError(f"{settings.__name__}.{name} is not declared as an option")  # a kvq bug
    made = [_parameter(fields[n], hints[n], (help or {}).get(n)) for n in names]

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        # typer passes the click context to the one parameter typed `typer.Context`: the command's, else ours
        context = next((p.name for p in signature.parameters.values() if p.annotation is typer.Context), None)
        parameters = []
        if context is None:
            parameters.append(inspect.Parameter(f"{param}_context", _KEYWORD, annotation=typer.Context))
        for p in signature.parameters.values():  # typer passes keywords only: the order is --help's
            parameters += made if p.name == param else [p.replace(kind=_KEYWORD)]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            ctx = kwargs[context] if context else kwargs.pop(f"{param}_context")
            values = {n: kwargs.pop(n) for n in names}
            return command(**kwargs, **{param: GivenOptions(values, given(ctx, values))})

        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return typing.cast(F, run)

    return decorate


def given(ctx: typer.Context, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `values` (parameters of the running command) that the command line or an environment
    variable set; not those left at their default."""
    return {n: v for n, v in values.items() if getattr(ctx.get_parameter_source(n), "name", None) in _GIVEN}


def _parameter(field: dataclasses.Field, hint: Any, help_text: str | None) -> inspect.Parameter:
    """The typer parameter of one option field: `--name` (a bool that defaults to False: a plain flag)."""
    meta = field.metadata
    flag = "--" + field.name.replace("_", "-")
    kind = _cli_type(hint)
    decls = (flag if field.default is False else f"{flag}/--no-{flag[2:]}",) if kind is bool else (flag,)
    check = meta.get("check")
    info = typer.Option(
        *decls,
        help=help_text or meta["help"],
        envvar=meta.get("envvar"),
        callback=(lambda value: value if value is None else check(value)) if check else None,
    )
    default = field.default
    if default is not None and kind is str and not isinstance(default, str):
        default = str(default)  # e.g. a byte size: typed as text
    return inspect.Parameter(field.name, _KEYWORD, default=default, annotation=Annotated[kind, info])


def _cli_type(hint: Any) -> Any:
    """What the command line parses a field typed `hint` as: `str | int | None` (a size) is text."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [a for a in args if a is not type(None)]
    kind = str if str in kinds else kinds[0]
    return kind | None if type(None) in args else kind
