"""The one registry of domains: env-gateway, reward, the eval gate, the warm start, the
demonstrations and the SFT evaluation all look a domain up here, by name.

Where domains come from, later ones replacing earlier ones of the same name:
- every package under libs/domains/ whose `__init__.py` defines `DOMAIN` (the built-ins);
- `register_domain(domain)`, from code that runs in the same process before it is needed;
- every folder of `RLPIPE_DOMAIN_PATHS` (folders separated by ':'), each a package with a
  `DOMAIN`, imported the first time it is listed; read at each lookup, so every service
  started with the variable sees the same domains.

    make_env("calc")                      # a new CalcEnv
    rubric_for("recall")                  # recall's rubric
    harness_for("recall", template)       # the harness limits recall's episodes are made for
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from libs.chat.template import ChatTemplate
from libs.domains.domain import Domain
from libs.envs.base import Environment
from libs.reward.rubric import Rubric
from libs.rollout.agent import AgentSettings

DOMAIN_PATHS_VAR = "RLPIPE_DOMAIN_PATHS"
BUILTIN_DIR = Path(__file__).resolve().parent
_REGISTERED: dict[str, Domain] = {}


class UnknownDomainError(KeyError):
    """No domain is registered under this name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown domain"


def _domain_of(module: object, where: str) -> Domain:
    found = getattr(module, "DOMAIN", None)
    if not isinstance(found, Domain):
        raise ValueError(f"{where} defines no DOMAIN = Domain(...) in its __init__.py")
    return found


@functools.cache
def builtin_domains() -> dict[str, Domain]:
    """The domains shipped under libs/domains/, by name."""
    found = {}
    for init in sorted(BUILTIN_DIR.glob("*/__init__.py")):
        module = importlib.import_module(f"libs.domains.{init.parent.name}")
        domain = _domain_of(module, f"libs/domains/{init.parent.name}")
        found[domain.name] = domain
    return found


@functools.cache
def load_domain_folder(folder: Path) -> Domain:
    """The DOMAIN of the package at `folder` (imported once, under a name of its own, so
    its modules import each other relatively: `from .env import MyEnv`)."""
    init = folder / "__init__.py"
    if not init.is_file():
        raise ValueError(f"domain folder {folder}: no __init__.py (a domain is a package)")
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    name = f"rlpipe_domain_{folder.name.replace('-', '_')}_{digest}"
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None, f"{init} is a file"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return _domain_of(module, f"domain folder {folder}")


def plugin_folders() -> list[Path]:
    """The folders of RLPIPE_DOMAIN_PATHS, resolved, in order."""
    value = os.environ.get(DOMAIN_PATHS_VAR, "")
    return [Path(part).resolve() for part in value.split(os.pathsep) if part.strip()]


def register_domain(domain: Domain) -> None:
    """Make `domain` available to every lookup in this process."""
    _REGISTERED[domain.name] = domain


def domains() -> dict[str, Domain]:
    """Every known domain by name: built-ins, registered ones, RLPIPE_DOMAIN_PATHS folders."""
    found = {**builtin_domains(), **_REGISTERED}
    for folder in plugin_folders():
        domain = load_domain_folder(folder)
        found[domain.name] = domain
    return found


def domain_names() -> list[str]:
    """Names of every known domain, sorted."""
    return sorted(domains())


def domain(name: str) -> Domain:
    """The domain `name`; UnknownDomainError names the known ones."""
    known = domains()
    if name not in known:
        raise UnknownDomainError(
            f"unknown domain {name!r}; known: {', '.join(sorted(known)) or 'none'} "
            f"(a folder of your own: {DOMAIN_PATHS_VAR}=/path/to/folder)"
        )
    return known[name]


def make_env(name: str) -> Environment:
    """A new instance of domain `name`'s environment (ValueError for a domain whose
    environment runs in a process of its own)."""
    factory = domain(name).env
    if factory is None:
        raise ValueError(f"domain {name!r}: its environment is a process of its own (env=None)")
    return factory()


def served_domains() -> list[str]:
    """Names of the domains whose environment runs in env-gateway, sorted."""
    return sorted(name for name, found in domains().items() if found.env is not None)


def rubric_for(name: str) -> Rubric:
    """Domain `name`'s rubric, as it scores rollouts (no judge criteria)."""
    return domain(name).rubric()


def harness_for(name: str, template: ChatTemplate) -> AgentSettings:
    """The harness limits domain `name`'s episodes are made for, in `template`'s tokens."""
    return domain(name).harness(template)
