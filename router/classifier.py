"""Turn the policy's ``classifier`` setting into a scorer, or into none at all.

The classifier package is built separately and imported only here, lazily (scikit-learn is not cheap), so the
router starts, and routes by its rules, on a checkout without a trained classifier: ``"default"`` with no usable
shipped classifier means "no classifier", with a warning, not an error. A file named explicitly must load,
because someone asked for it.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from backends.errors import ModelLoadError
from router.errors import ConfigError

if TYPE_CHECKING:
    from classifiers import Scorer

log = logging.getLogger(__name__)


def resolve_scorer(spec: str | None) -> Scorer | None:
    """``None``: no classifier; ``"default"``: ``classifiers.load_default()`` if it can; else a classifier file."""
    if spec is None:
        return None
    if spec == "default":
        load_default = getattr(_import("classifiers"), "load_default", None)
        if load_default is None:
            log.warning("classifiers.load_default() does not exist; routing by rules and default_pool")
            return None
        try:
            return load_default()
        except (FileNotFoundError, ModelLoadError) as exc:
            log.warning("no usable default classifier (%s); routing by rules and default_pool", exc)
            return None
    classifiers = _import("classifiers")
    if classifiers is None:
        raise ConfigError("policy.classifier", "classifier files need the classifiers package, which is missing")
    try:
        return classifiers.load_scorer(spec)
    except ModelLoadError as exc:
        raise ConfigError("policy.classifier", exc.message) from exc


def _import(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not name.startswith(exc.name):
            raise
        return None
