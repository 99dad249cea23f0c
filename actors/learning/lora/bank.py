"""AdapterBank: one copy of the base model per trainer rank, holding every LoRA adapter it trains or scores.

Before this, a rank loaded the base model again for every switch between adapters, and the
quality gate loaded a further copy for every version it scored. Here the base weights are loaded
once, in the rank's training dtype (bf16 where the device computes it natively,
``actors.models.devices.training_dtype``), and adapters come and go on top of them as ``peft`` adapters of
one ``PeftModel``:

- each adapter in training has a slot (``peft`` adapter name ``<adapter>@<n>``) and its own
  AdamW; switching adapters is ``set_adapter``, not a reload;
- a version to score (a candidate, the served version) is loaded into a temporary slot, scored
  with it active in eval mode under ``no_grad``, and deleted; the base model is scored with
  every adapter disabled, the same way DPO's reference is computed;
- a slot that must start again from another version (a rollback, a rejected candidate) is loaded
  fresh before the old one is deleted, so the model always has an adapter.

Everything runs on the caller's thread: the rank scores between its training steps, never
concurrently, because ``set_adapter`` changes which adapter the one model computes with.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.learning.lora.steps import lora_config, seed_everything
from actors.models.devices import torch_device, training_dtype


@dataclass
class _Slot:
    peft_name: str  # the adapter's name inside the PeftModel
    version: int | None  # the store version the weights started from (None: a fresh LoRA)
    optimizer: torch.optim.Optimizer


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far (AdamW's per-parameter ``step``; 0 before the first)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is not None:
            return int(step)
    return 0


def warmed_up(learning_rate: float, steps_done: int, warmup_steps: int) -> float:
    """The learning rate of the next optimizer step: linear warm-up, (steps_done + 1) / warmup_steps of it."""
    if warmup_steps <= 0:
        return learning_rate
    return learning_rate * min(1.0, (steps_done + 1) / warmup_steps)


class AdapterBank:
    """The rank's one model: base weights loaded once, LoRA adapters switched on top of them."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", device: str | None = None, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = device or torch_device()
        self.dtype_name = training_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, self.dtype_name)).to(
            self.device
        )
        self.model: Any = None  # the PeftModel, made with the first adapter
        self.seed = seed
        self._slots: dict[str, _Slot] = {}
        self._names = itertools.count()
        self.active: str | None = None  # the adapter whose slot computes now

    # ---- adapters in training ---------------------------------------------------------------

    def train(
        self,
        adapter: str,
        lora: Any,
        version: int | None,
        path: str | None,
        learning_rate: float,
        warmup_steps: int = 0,
    ) -> tuple[Any, torch.optim.Optimizer]:
        """Make ``adapter`` the one that computes, starting from ``version`` (its files at ``path``) unless its
        slot already holds that version's line; returns ``(model, optimizer)``.

        ``warmup_steps``: the learning rate rises linearly over the adapter's first optimizer steps (counted
        by its optimizer, whose state a version keeps), so its first versions move the weights less.
        """
        slot = self._slots.get(adapter)
        if slot is None or slot.version != version:
            slot = self._load(adapter, lora, version, path, learning_rate)
        self._activate(slot.peft_name, trainable=True)
        self.active = adapter
        rate = warmed_up(learning_rate, optimizer_steps(slot.optimizer), warmup_steps)
        for group in slot.optimizer.param_groups:  # the adapter's current learning rate (PATCH) wins
            group["lr"] = rate
        return self.model, slot.optimizer

    def advance(self, adapter: str, version: int) -> None:
        """The slot's weights are now ``version`` (the rank just published them): no reload when it is served."""
        self._slots[adapter].version = version

    def forget(self, adapter: str) -> None:
        """Drop the adapter's slot (its unpublished work is abandoned); the next ``train`` loads afresh."""
        slot = self._slots.pop(adapter, None)
        if slot is not None:
            self._delete(slot.peft_name)
            if self.active == adapter:
                self.active = None

    def optimizer(self, adapter: str) -> torch.optim.Optimizer:
        return self._slots[adapter].optimizer

    def peft_name(self, adapter: str) -> str:
        return self._slots[adapter].peft_name

    @property
    def adapters(self) -> dict[str, int | None]:
        """Adapter -> the version its slot started from."""
        return {name: s.version for name, s in self._slots.items()}

    def _load(self, adapter: str, lora: Any, version: int | None, path: str | None, learning_rate: float) -> _Slot:
        from actors.learning.lora.steps import make_optimizer

        # A tenant's adapter is keyed tenant/name; peft keeps the name in module keys and file names: no '/'.
        peft_name = f"{adapter.replace('/', '~')}@{next(self._names)}"
        seed_everything(self.seed)  # a fresh LoRA's A matrices are the same on every rank
        try:
            self._add(peft_name, lora, path, trainable=True)
            self._activate(peft_name, trainable=True)
            optimizer = make_optimizer(self.model, learning_rate, state_dir=path)
        except Exception:
            # A version that does not fit this base (trained for another model), bad target modules:
            # the adapter's fault. Leave the model as it was, so the other adapters train on.
            self._discard(peft_name)
            raise
        old = self._slots.get(adapter)
        slot = self._slots[adapter] = _Slot(peft_name, version, optimizer)
        if old is not None:
            self._delete(old.peft_name)
        return slot

    # ---- scoring --------------------------------------------------------------------------------

    @contextmanager
    def scoring(self, lora: Any, path: str | None) -> Iterator[Any]:
        """The model computing as the version at ``path`` (None: the base model), in eval mode without gradients;
        the adapter in training computes again afterwards."""
        restore = self._slots[self.active].peft_name if self.active in self._slots else None
        was_training = self.model.training if self.model is not None else True
        temp = None
        try:
            if path is None and self.model is None:
                self.base.eval()
                with torch.no_grad():
                    yield self.base
                return
            if path is None:
                self.model.eval()
                with torch.no_grad(), self.model.disable_adapter():
                    yield self.model
                return
            temp = f"score@{next(self._names)}"
            self._add(temp, lora, path, trainable=False)
            self._activate(temp, trainable=False)
            self.model.eval()
            with torch.no_grad():
                yield self.model
        finally:
            if temp is not None:
                if restore is not None:
                    self._activate(restore, trainable=True)
                self._delete(temp)
            target = self.model if self.model is not None else self.base
            target.train(was_training)

    # ---- peft bookkeeping -----------------------------------------------------------------------

    def _add(self, peft_name: str, lora: Any, path: str | None, *, trainable: bool) -> None:
        from peft import get_peft_model

        if self.model is None and path is not None:
            # Wrap the base with a fresh slot first: loading stored files straight into the base
            # (PeftModel.from_pretrained) would leave it half-wrapped if the files do not fit it.
            self.model = get_peft_model(self.base, lora_config(lora), adapter_name=f"{peft_name}~fresh")
        if self.model is None:
            self.model = get_peft_model(self.base, lora_config(lora), adapter_name=peft_name)
        elif path is not None:
            self.model.load_adapter(str(path), adapter_name=peft_name, is_trainable=trainable)
        else:
            self.model.add_adapter(peft_name, lora_config(lora))
        self.model.to(self.device)

    def _discard(self, peft_name: str) -> None:
        """Remove a slot that failed to load, whatever it got to (another adapter computes next anyway)."""
        if self.model is None or peft_name not in self.model.peft_config:
            return
        others = [n for n in self.model.peft_config if n != peft_name]
        if others:
            self.model.set_adapter(others[0])
            self.model.delete_adapter(peft_name)
        if self.active is not None and self.active not in self._slots:
            self.active = None

    def _activate(self, peft_name: str, *, trainable: bool) -> None:
        self.model.set_adapter(peft_name, inference_mode=not trainable)

    def _delete(self, peft_name: str) -> None:
        # The last adapter stays (inactive until a slot replaces it): peft has no model without one.
        if self.model is not None and peft_name in self.model.peft_config and len(self.model.peft_config) > 1:
            active = self.model.active_adapter
            self.model.delete_adapter(peft_name)
            if active != peft_name and active in self.model.peft_config:
                self.model.set_adapter(active)  # keep the computing adapter trainable
