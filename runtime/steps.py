"""A minimal optimizer-step tracker, used only while runtime.framework is not importable.

The CRIU engine needs nothing from the framework engine except a step boundary: the global
optimizer post-step hook. runtime.framework.install() provides the same interface (and much
more); rank.py prefers it.
"""
from torch.optim.optimizer import register_optimizer_step_post_hook


class StepTracker:
    def __init__(self):
        self.step = 0
        self._listeners = []
        self._handle = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs):
        self.step += 1
        for listener in list(self._listeners):
            listener(self.step)

    def add_step_listener(self, listener):
        self._listeners.append(listener)

    def save(self, directory):
        raise RuntimeError("the framework checkpoint engine (runtime/framework.py) is not "
                           "installed in this tree; use --engine criu")

    def check_resumable(self):
        raise RuntimeError("the framework checkpoint engine (runtime/framework.py) is not "
                           "installed in this tree; use --engine criu")
