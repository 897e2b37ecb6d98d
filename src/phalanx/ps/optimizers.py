"""Optimizers a parameter server runs besides ``torch.optim``'s: Keras updates that torch has no twin for.

Keras optimizers used under ParameterServerStrategy are applied on the servers. Most map onto a
``torch.optim`` class with the same update (SGD, Adam, AdamW, Adagrad). Keras' RMSprop does not:
it adds epsilon *inside* the square root (``sqrt(v + eps)``), torch outside (``sqrt(v) + eps``). With
Keras' default epsilon of 1e-7 the floor of the denominator differs by 3000x, and on small gradients
torch's update is far larger: a model Keras' RMSprop trains diverged under torch's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class KerasRMSprop(torch.optim.Optimizer):
    """Keras 3's ``RMSprop`` update, step for step (``keras.optimizers.RMSprop.update_step``).

    Args:
        params: the parameters.
        lr: learning rate. rho: the velocity's decay. eps: added to the velocity inside the
            square root. momentum: Keras' momentum (of the increments). centered: subtract the
            squared mean gradient from the velocity.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        rho: float = 0.9,
        eps: float = 1e-7,
        momentum: float = 0.0,
        centered: bool = False,
    ) -> None:
        super().__init__(params, {"lr": lr, "rho": rho, "eps": eps, "momentum": momentum, "centered": centered})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            rho, eps, lr, momentum = group["rho"], group["eps"], group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if not state:
                    state["velocity"] = torch.zeros_like(p)
                    if momentum > 0:
                        state["momentum"] = torch.zeros_like(p)
                    if group["centered"]:
                        state["average_grad"] = torch.zeros_like(p)
                velocity = state["velocity"]
                velocity.mul_(rho).addcmul_(grad, grad, value=1 - rho)
                if group["centered"]:
                    average = state["average_grad"]
                    average.mul_(rho).add_(grad, alpha=1 - rho)
                    denominator = (velocity - average * average + eps).sqrt()
                else:
                    denominator = (velocity + eps).sqrt()
                increment = grad * lr / denominator
                if momentum > 0:
                    state["momentum"].mul_(momentum).add_(increment)
                    p.sub_(state["momentum"])
                else:
                    p.sub_(increment)
        return loss


SERVER_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"KerasRMSprop": KerasRMSprop}
