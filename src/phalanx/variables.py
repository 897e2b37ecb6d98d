"""Capturing the parameters and buffers created inside ``strategy.scope()``.

torch calls a global *registration hook* whenever a module registers a parameter or buffer;
plain ``nn.Module`` subclasses and Keras-on-torch layers both go through it. phalanx installs the
hook only while a scope is open and only acts for modules created under *its* strategy in the
current thread, so nothing is monkey-patched and nothing outside the scope is touched.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from phalanx import context


@contextlib.contextmanager
def capture(owner: object, device: torch.device,
            on_parameter: Callable[[torch.nn.Parameter], None],
            on_buffer: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Calls ``on_parameter`` / ``on_buffer`` for every tensor registered under ``owner``'s scope.

    Tensors are created on ``device`` (``torch.device`` as a context manager sets the default
    device for factory functions); stragglers created elsewhere are moved there.
    """

    def on_param(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None):
        if param is None or context.get_strategy() is not owner:
            return None
        if param.device != device:
            param = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
            on_parameter(param)
            return param
        on_parameter(param)
        return None

    def on_buf(module: torch.nn.Module, name: str, buffer: torch.Tensor | None):
        if buffer is None or context.get_strategy() is not owner:
            return None
        if buffer.device != device:
            buffer = buffer.to(device)
            on_buffer(buffer)
            return buffer
        on_buffer(buffer)
        return None

    param_hook = register_module_parameter_registration_hook(on_param)
    buffer_hook = register_module_buffer_registration_hook(on_buf)
    try:
        # The default-device mode intercepts every torch call; on the CPU it would only cost time.
        with torch.device(device) if device.type != "cpu" else contextlib.nullcontext():
            yield
    finally:
        param_hook.remove()
        buffer_hook.remove()
