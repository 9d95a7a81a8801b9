"""``MirroredScheduler`` for the scheduler tests (imported by name: pytest puts this folder on
``sys.path`` for its test modules)."""

from __future__ import annotations

import pickle

from pagedllm.core.scheduler import Scheduler
from pagedllm.worker.request_states import RequestStates


class MirroredScheduler(Scheduler):
    """A ``Scheduler`` whose outputs also get ``scheduled``: the step as the worker rebuilds it
    (``worker.request_states.RequestStates``) from the message after a pickle round trip, so the
    assertions check what actually crosses the engine-worker boundary."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.worker_states = RequestStates()

    def schedule(self):
        out = super().schedule()
        out.scheduled = self.worker_states.update(pickle.loads(pickle.dumps(out)))
        return out
