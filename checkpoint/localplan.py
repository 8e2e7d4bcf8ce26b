"""A model + optimizer's own state dict, replayed from the objects it names instead of rebuilt.

A tier-0 snapshot (:mod:`trainguard.checkpoint.memory`) takes ``ModelOptimizerState.local_state_dict()``
at every step: the module's ``state_dict()`` walks every submodule, the optimizer's packs every
parameter's state, and the snapshot then walks the result again to find its tensors. On the bench
model that is half of what a snapshot blocks the training thread for, and between two steps nothing
in it changes but the tensors' values and the optimizer's hyperparameters.

:class:`LocalPlan` records, from one full ``local_state_dict()``, where each of its tensors lives (the
module's ``_parameters`` / ``_buffers`` entry, the optimizer's per-parameter state entry) and the
skeleton the snapshot made of it. :meth:`LocalPlan.replay` checks that every one of those entries still
holds the same object, with the same shape and dtype, and that nothing was registered anywhere since
(a global module registration hook counts parameters, buffers and submodules registered); then it hands
back the same tensors and skeleton, re-reading only what may change from step to step (the parameter
groups' values, the entry's extras such as a loss scaler's scale). When any check fails it returns None
and the snapshot takes the full path again (and builds a new plan).

A plan is built only where the full path is plain: the entry's ``local_state_dict`` is
``ModelOptimizerState``'s; no module has a state-dict hook or overrides ``state_dict``,
``_save_to_state_dict`` or ``get_extra_state``; the optimizer's ``state_dict`` is ``Optimizer``'s,
without hooks, its state all tensors and its hyperparameters none. FSDP2 (a state-dict pre-hook
reshards the parameters) and DeepSpeed take the full path.
"""

from __future__ import annotations

import pickle
from operator import attrgetter, is_
from typing import Any, Callable

import torch

from trainguard.checkpoint.state import ModelOptimizerState

_meta = attrgetter("shape", "dtype")

_epoch = 0
_hooks: list[Any] = []


def _bump(*_: Any) -> None:
    global _epoch
    _epoch += 1


def _install() -> None:
    """Count every parameter, buffer and submodule registration in this process (once)."""
    if not _hooks:
        from torch.nn.modules import module as m

        _hooks.extend([m.register_module_parameter_registration_hook(_bump),
                       m.register_module_buffer_registration_hook(_bump),
                       m.register_module_module_registration_hook(_bump)])


_PLAIN = (torch.nn.Module.state_dict, torch.nn.Module._save_to_state_dict, torch.nn.Module.get_extra_state)


def _plain_module(model: torch.nn.Module) -> bool:
    for mod in model.modules():
        t = type(mod)
        if (t.state_dict, t._save_to_state_dict, t.get_extra_state) != _PLAIN:
            return False
        if mod._state_dict_hooks or mod._state_dict_pre_hooks:
            return False
    return True


def _plain_optimizer(opt: Any) -> bool:
    if not isinstance(opt, torch.optim.Optimizer) or type(opt).state_dict is not torch.optim.Optimizer.state_dict:
        return False
    if opt._optimizer_state_dict_pre_hooks or opt._optimizer_state_dict_post_hooks:
        return False
    if any(not isinstance(v, torch.Tensor) for st in opt.state.values() for v in st.values()):
        return False
    return not any(isinstance(v, torch.Tensor) for g in opt.param_groups for k, v in g.items() if k != "params")


def _pack(opt: Any, ids: list[list[int]]) -> list[dict[str, Any]]:
    """``opt.state_dict()["param_groups"]``: each group's values, its parameters as indices ``ids``."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": i} for g, i in zip(opt.param_groups, ids)]


def _tree(mod: torch.nn.Module, refs: list[tuple[dict[Any, Any], Any, Any]]) -> bool:
    """Append every submodule edge under ``mod`` as ``(parent._modules, name, child)``, as
    ``state_dict()`` recurses (a shared submodule once per edge): ``del parent.child`` runs no
    registration hook, the edge catches it. False when a container is not a plain dict."""
    if type(mod._modules) is not dict:
        return False
    for name, child in mod._modules.items():
        if child is not None:
            refs.append((mod._modules, name, child))
            if not _tree(child, refs):
                return False
    return True


class _Pickled:
    """A constant part of a skeleton, pickled once; it unpickles as the object itself."""

    __slots__ = ("data",)

    def __init__(self, obj: Any) -> None:
        self.data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce__(self) -> tuple[Any, ...]:
        return pickle.loads, (self.data,)


class LocalPlan:
    """Where the tensors of one ``local_state_dict()`` live; see the module docstring. Build with
    :meth:`build`; only :meth:`replay` is called per snapshot."""

    def __init__(self, entry: Any, base: int, sources: list[torch.Tensor], model_skel: Any, state_skel: Any,
                 refs: list[tuple[dict[Any, Any], Any, Any]], ids: list[list[int]]) -> None:
        self.entry, self.base, self.sources = entry, base, sources
        self._sig = list(map(_meta, sources))  # (shape, dtype) of each: the slot signature, and the check
        # the constant parts of the skeleton, pickled once (a snapshot pickles its skeleton every time)
        self._model_skel, self._state_skel = _Pickled(model_skel), _Pickled(state_skel)
        self._containers = [c for c, _, _ in refs]
        self._keys = [k for _, k, _ in refs]
        self._objs = [o for _, _, o in refs]
        opt = entry.optimizer
        self._dicts = [opt.state, *(st for _, _, st in refs if isinstance(st, dict))]
        self._lens = [len(d) for d in self._dicts]
        self._ids = ids
        self._group_lens = [len(g["params"]) for g in opt.param_groups]
        self._state, self._param_groups = opt.state, opt.param_groups  # load_state_dict replaces both
        self._model, self._opt = entry.model, opt
        self._epoch = _epoch

    @classmethod
    def build(cls, entry: Any, sd: dict[str, Any], part: Any, appended: list[torch.Tensor],
              base: int) -> LocalPlan | None:
        """A plan for ``entry`` from its full ``local_state_dict()`` ``sd``, whose skeleton ``part`` put its
        tensors ``appended`` at ``base`` onward; None where the full path is not plain (module docstring)
        or the objects do not account for every tensor."""
        if not isinstance(entry, ModelOptimizerState) or \
                type(entry).local_state_dict is not ModelOptimizerState.local_state_dict:
            return None
        model, opt = entry.model, entry.optimizer
        if opt is None or not isinstance(part, dict) or not _plain_module(model) or not _plain_optimizer(opt):
            return None
        _install()
        kept = model.state_dict(keep_vars=True)
        if list(kept) != list(sd["model"]):
            return None
        refs: list[tuple[dict[Any, Any], Any, Any]] = []  # (container, key, the object it must still hold)
        if not _tree(model, refs):
            return None
        for key, obj in kept.items():
            prefix, _, attr = key.rpartition(".")
            mod = model.get_submodule(prefix)
            for container in (mod._parameters, mod._buffers):
                if type(container) is dict and container.get(attr) is obj:
                    refs.append((container, attr, obj))
                    break
            else:
                return None
        optimized = {id(p) for g in opt.param_groups for p in g["params"]}
        ids, n = [], 0
        for g in opt.param_groups:
            ids.append(list(range(n, n + len(g["params"]))))
            n += len(g["params"])
        opt_tensors = []
        for p, st in opt.state.items():  # the order Optimizer.state_dict packs them in
            if id(p) not in optimized or type(st) is not dict:
                return None
            refs.append((opt.state, p, st))
            for k, v in st.items():
                refs.append((st, k, v))
                opt_tensors.append(v)
        if sd["optim"].get("param_groups") != _pack(opt, ids):
            return None
        sources = [*kept.values(), *opt_tensors]
        if len(sources) > len(appended) or any(
                a.data_ptr() != s.data_ptr() or a.shape != s.shape or a.dtype != s.dtype
                for a, s in zip(appended, sources)):
            return None
        if not isinstance(part.get("optim"), dict) or "model" not in part or "state" not in part["optim"]:
            return None
        return cls(entry, base, sources, part["model"], part["optim"]["state"], refs, ids)

    def replay(self, entry: Any, out: list[torch.Tensor], sig: list[tuple[tuple[int, ...], torch.dtype]],
               skeleton: Callable[[Any, list[torch.Tensor], list[Any]], Any]) -> Any:
        """``skeleton(entry.local_state_dict(), out, sig)`` from the recorded objects (appending the same
        tensors, returning the same skeleton), or None when anything they were recorded from changed."""
        opt = self.entry.optimizer
        if (entry is not self.entry or self._epoch != _epoch or len(out) != self.base
                or entry.model is not self._model or opt is not self._opt
                or opt.state is not self._state or opt.param_groups is not self._param_groups):
            return None
        if not all(map(is_, map(dict.get, self._containers, self._keys), self._objs)):
            return None  # a parameter, buffer or optimizer state entry replaced
        if list(map(len, self._dicts)) != self._lens or [len(g["params"]) for g in opt.param_groups] != self._group_lens:
            return None  # an entry added
        if list(map(_meta, self.sources)) != self._sig:
            return None  # ``.data`` swapped in place (e.g. ``model.half()``)
        out.extend(self.sources)
        sig.extend(self._sig)
        part = {"model": self._model_skel,
                "optim": {"state": self._state_skel, "param_groups": skeleton(_pack(opt, self._ids), out, sig)}}
        for k, v in entry.local_extras().items():
            part[k] = skeleton(v, out, sig)
        return part


__all__ = ["LocalPlan"]
