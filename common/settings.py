"""Typed settings models: each setting declared once, everything else derived from it.

A component's settings (``EngineArgs``, ``ServiceSettings``, ``KVStoreSettings``,
``RouterArgs``, ``UpArgs``; docs/design.md §3 "Settings") are one dataclass whose fields are
declared with :func:`setting`: the name, the default, the unit, the argparse type that
converts and validates a string, the help text, the choices, and where the Helm chart sets
it. From that one declaration :class:`ArgsModel` derives

- the argparse flags (``add_arguments``), each defaulting to its ``PDSERVE_*`` twin
  (``common.flags``: ``--max-num-seqs`` ← ``PDSERVE_MAX_NUM_SEQS``);
- the model from parsed flags (``from_args``) or from the environment alone (``from_env``);
- the command-line words of the settings a parsed namespace has set
  (``forwarded_words``), which is how `pdserve up` forwards engine settings to its children;
- the declarations themselves (``settings``), which the tests check the Helm chart's
  ``values.schema.json`` and templates against.

Torch-free and imports nothing of ours outside ``common``, like ``common.flags``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from common.flags import add_env_argument, add_env_switch, env_name, parse_bool

_KEY = "pdserve.setting"


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting: a model field plus everything its command line and env twin need.

    ``name`` is the model's field; ``flag`` the command-line flag (default: the name with
    dashes); ``env`` its ``PDSERVE_*`` twin; ``dest`` the argparse attribute. ``switch``:
    a ``store_true`` flag (the env twin takes 1/0, true/false, yes/no). ``unit`` ("s",
    "bytes", "tokens", ...) follows the default in the help text. ``helm``: the chart
    values (dotted paths in ``values.yaml``) that set this setting's env twin in a pod; a
    test checks their ``values.schema.json`` against this declaration and the rendered
    pods against the command line. ``roles``: only these service roles ("prefill",
    "decode") have the flag; empty = all. ``forward``: `pdserve up` accepts the flag and
    passes it on (an engine setting to every engine, a router setting to its router). ``many``: the flag takes one or more values
    (a list; its env twin holds one, as typed).
    """

    name: str = ""
    flag: str = ""
    default: Any = None
    type: Callable[[str], Any] = str
    help: str = ""
    choices: tuple[Any, ...] | None = None
    switch: bool = False
    unit: str = ""
    helm: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    forward: bool = False
    many: bool = False
    aliases: tuple[str, ...] = ()  # other spellings of a valued flag (vLLM's ``-pp``)

    @property
    def env(self) -> str:
        return env_name(self.flag)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def replace(self, **changes: Any) -> Setting:
        """A copy with ``changes`` (e.g. `pdserve up`'s forwarded copy: no default)."""
        return dataclasses.replace(self, **changes)

    def add_to(self, parser: Any, environ: Mapping[str, str] | None = None) -> None:
        """Add this setting's flag to ``parser`` (a parser or an argument group)."""
        if self.switch:
            add_env_switch(parser, self.flag, help=self.help, environ=environ)
            return
        if self.many:
            self._add_many(parser, environ)
            return
        choices = list(self.choices) if self.choices is not None else None
        add_env_argument(
            parser,
            self.flag,
            type=self.type,
            default=self.default,
            help=self.help,
            choices=choices,
            environ=environ,
            unit=self.unit,
            aliases=self.aliases,
        )

    def _add_many(self, parser: Any, environ: Mapping[str, str] | None) -> None:
        # argparse converts only string defaults, so the env twin's text is kept as given
        # and the model converts the list (as it does flag values) when it is built.
        env = os.environ if environ is None else environ
        raw = env.get(self.env)
        parser.add_argument(
            self.flag,
            nargs="+",
            type=self.type,
            default=[raw] if raw else list(self.default or ()),
            help=f"{self.help} (env {self.env})",
        )

    def add_plain(self, parser: Any) -> None:
        """Add the flag without its env twin: a tool that mirrors a component's flags
        (``pdserve bench throughput``) takes its values from its command line alone."""
        if self.switch:
            parser.add_argument(self.flag, action="store_true", help=self.help)
            return
        choices = list(self.choices) if self.choices is not None else None
        parser.add_argument(
            self.flag,
            *self.aliases,
            type=self.type,
            default=self.default,
            choices=choices,
            help=self.help,
        )

    def from_text(self, text: str) -> Any:
        """The value of an env twin's text, converted and checked as the flag's would be;
        ``ValueError`` carries the converter's reason (choices are the model's to check)."""
        if self.switch:
            return parse_bool(text)
        try:
            return [self.type(text)] if self.many else self.type(text)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{self.env}: {exc}") from None

    def words(self, value: Any) -> list[str]:
        """``value`` as command-line words (none for None or a switch that is off)."""
        if value is None or (self.switch and not value) or (self.many and not value):
            return []
        if self.many:
            return [self.flag, *map(str, value)]
        return [self.flag] if self.switch else [self.flag, str(value)]


def setting(
    default: Any = None,
    *,
    flag: str = "",
    type: Callable[[str], Any] = str,  # noqa: A002 - mirrors argparse
    help: str = "",  # noqa: A002 - mirrors argparse
    choices: Iterable[Any] | None = None,
    switch: bool = False,
    unit: str = "",
    helm: str | tuple[str, ...] = (),
    roles: tuple[str, ...] = (),
    forward: bool = False,
    many: bool = False,
    repr: bool = True,  # noqa: A002 - mirrors dataclasses.field; False for secrets
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field that is a setting (see :class:`Setting`); ``default`` is both the
    field's and the flag's default (a switch defaults to off; ``many``: a tuple)."""
    spec = Setting(
        flag=flag,
        default=False if switch else default,
        type=type,
        help=help,
        choices=tuple(choices) if choices is not None else None,
        switch=switch,
        unit=unit,
        helm=((helm,) if isinstance(helm, str) else tuple(helm)) if helm else (),
        roles=roles,
        forward=forward,
        many=many,
        aliases=aliases,
    )
    return dataclasses.field(default=spec.default, repr=repr, metadata={_KEY: spec})


M = TypeVar("M", bound="ArgsModel")


class ArgsModel:
    """Mixin of a settings dataclass: the flags, env twins and forwarding, derived."""

    GROUP: ClassVar[str] = ""  # argparse group title of the flags ("" = no group)

    @classmethod
    def settings(cls) -> tuple[Setting, ...]:
        """Every setting of the model, in declaration order (which is the help's order)."""
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec = f.metadata.get(_KEY)
            if spec is not None:
                flag = spec.flag or "--" + f.name.replace("_", "-")
                out.append(spec.replace(name=f.name, flag=flag))
        return tuple(out)

    @classmethod
    def setting(cls, name: str) -> Setting:
        """The setting of field ``name``."""
        for s in cls.settings():
            if s.name == name:
                return s
        raise KeyError(f"{cls.__name__} has no setting {name!r}")

    @classmethod
    def forwarded(cls, prefix: str = "") -> tuple[Setting, ...]:
        """The settings declared ``forward=True``, as `pdserve up` takes them to pass on:
        unset by default (None, a switch off), so only what a user set travels."""
        return tuple(
            s.replace(default=False if s.switch else None, help=prefix + s.help)
            for s in cls.settings()
            if s.forward
        )

    @classmethod
    def add_arguments(
        cls,
        parser: Any,
        *,
        role: str = "",
        defaults: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """Add the model's flags (those of ``role`` when given); ``defaults`` overrides
        built-in defaults by field name (a service's port depends on its role)."""
        target = parser.add_argument_group(cls.GROUP) if cls.GROUP else parser
        for s in cls.settings():
            if role and s.roles and role not in s.roles:
                continue
            if defaults and s.name in defaults:
                s = s.replace(default=defaults[s.name])
            s.add_to(target, environ)

    @classmethod
    def from_args(cls: type[M], args: argparse.Namespace, **extra: Any) -> M:
        """The model from a namespace parsed with ``add_arguments`` (a flag the parser did
        not add, e.g. another role's, keeps its default); ``extra`` sets other fields."""
        values = {s.name: getattr(args, s.dest) for s in cls.settings() if hasattr(args, s.dest)}
        model = cls(**values, **extra)
        model.validate()
        return model

    @classmethod
    def from_env(cls: type[M], env: Mapping[str, str] | None = None, **extra: Any) -> M:
        """The model from ``PDSERVE_*`` variables alone (``os.environ`` by default)."""
        env = os.environ if env is None else env
        values = {s.name: s.from_text(env[s.env]) for s in cls.settings() if s.env in env}
        model = cls(**values, **extra)
        model.validate()
        return model

    def validate(self) -> None:
        """Checks across settings, or of values built in code; ``ValueError`` naming the flag."""
        for s in self.settings():
            value = getattr(self, s.name)
            if s.choices is not None and value is not None and value not in s.choices:
                choices = ", ".join(map(str, s.choices))
                raise ValueError(f"{s.flag} must be one of {choices}, got {value!r}")


def checked_text(convert: Callable[[str], Any]) -> Callable[[str], str]:
    """argparse type: the text itself, once ``convert`` (a child's type) accepts it, so a
    value passed on to a child process travels as typed and fails here, not there."""

    def check(text: str) -> str:
        convert(text)
        return text

    check.__name__ = getattr(convert, "__name__", "value")
    return check


def forwarded_words(settings: Iterable[Setting], args: argparse.Namespace) -> list[str]:
    """The words of ``settings`` set in a parsed namespace (None = unset, not passed)."""
    words: list[str] = []
    for s in settings:
        words += s.words(getattr(args, s.dest, None))
    return words
