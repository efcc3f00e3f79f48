"""Training state off the accelerator while vLLM refits and generates
(``train.offload_training_state``): gradient buffers freed by Megatron DDP (back zeroed), the
optimizer's own storages moved to host memory and back bit for bit, the tensor objects unchanged.
How and why: docs/training.md#training-state-off-the-gpu-while-vllm-runs."""

from __future__ import annotations

from contextlib import contextmanager

import torch


class TrainingStateOffload:
    """Moves the gradient buffers and optimizer state of ``models`` / ``optimizer`` off the
    device and back. ``enabled=False`` makes every method a no-op (the default recipe)."""

    def __init__(self, models: list, optimizer, *, enabled: bool = True):
        self.models, self.optimizer, self.enabled = models, optimizer, enabled
        self.offloaded = False
        self._storages: list[torch.UntypedStorage] = []  # freed while offloaded
        self._host: list[torch.UntypedStorage] = []  # their copies, reused from step to step

    def offload(self) -> None:
        """Free the gradient buffers and the optimizer's own storages (host copies kept)."""
        if not self.enabled or self.offloaded:
            return
        cuda = torch.cuda.is_available()
        if cuda:  # an async checkpoint save may still be copying these tensors to the host
            torch.cuda.synchronize()
        for model in self.models:
            model.offload_grad_buffers(synchronize=False, empty_cache=False)
        storages = optimizer_storages(self.optimizer, self.models)
        if [h.nbytes() for h in self._host] != [s.nbytes() for s in storages]:
            self._host = [torch.UntypedStorage(s.nbytes(), device="cpu") for s in storages]
            if cuda:
                self._host = [h.pin_memory() for h in self._host]
        for storage, host in zip(storages, self._host):
            host.copy_(storage)
        if cuda:
            torch.cuda.synchronize()
        for storage in storages:
            storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()
        self._storages, self.offloaded = storages, True

    def restore(self) -> None:
        """Bring everything back (gradients zeroed, optimizer state bit for bit)."""
        if not self.enabled or not self.offloaded:
            return
        for storage, host in zip(self._storages, self._host):
            storage.resize_(host.nbytes())
            storage.copy_(host)
        for model in self.models:
            model.restore_grad_buffers(synchronize=torch.cuda.is_available())
        self._storages, self.offloaded = [], False

    @contextmanager
    def resident(self):
        """The state is on the device inside the block (a checkpoint save), and back where it
        was after it."""
        was = self.offloaded
        self.restore()
        try:
            yield
        finally:
            if was:
                self.offload()


def optimizer_storages(optimizer, models: list) -> list[torch.UntypedStorage]:
    """The distinct storages of ``optimizer``'s state tensors and param-group tensors that no
    model parameter (or DDP buffer) shares. Works through Megatron's wrappers
    (``ChainedOptimizer.chained_optimizers``, ``MegatronOptimizer.optimizer``)."""
    model_storages = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}
    for model in models:
        ddp_buffers = getattr(model, "buffers", None)  # Megatron DDP's list (a method elsewhere)
        if not isinstance(ddp_buffers, list):
            continue
        for buffer in ddp_buffers + model.expert_parallel_buffers:
            for data in (buffer.param_data, buffer.grad_data):
                if data is not None:
                    model_storages.add(data.untyped_storage().data_ptr())
    found: dict[int, torch.UntypedStorage] = {}
    for inner in _torch_optimizers(optimizer):
        tensors = [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in model_storages:
                found.setdefault(key, storage)
    return list(found.values())


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for sub in chained for inner in _torch_optimizers(sub)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []
