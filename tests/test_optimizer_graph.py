"""The bookkeeping of recpipe.speedups.optimizer_graph on CPU: when the dense
optimizer's step is captured, replayed or run eagerly, and that parameters and state
(Adagrad's host-side step counts included) come out bit-identical to the eager step.

There is no CUDA graph on CPU, so ``FakeGraph`` stands in for one with a graph's
semantics: capturing runs the step's host part only (the parameters and device state
are restored afterwards, as a capture executes no kernel), and a replay runs the
device part only, with the hyperparameters, parameters and state tensors of the
capture (the host state is restored afterwards). The real capture and its numerics
are checked on the GPU by tests/test_optimizer_graph_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from recpipe.pipelines import PipelineError
from recpipe.speedups.optimizer_graph import (
    HOST_STATE,
    MAX_CHANGES,
    WARMUP_CALLS,
    GraphedOptimizerStep,
    graph_steps,
    install,
    remove,
    torch_optimizers,
    unsupported,
)


class FakeGraph:
    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def __call__(self, step):
        opt = self.opt
        host_keys = HOST_STATE[type(opt)]
        groups = [dict(g) for g in opt.param_groups]
        state = copy.copy(opt.state)  # the per-parameter dicts of the capture, with its tensors
        state.update({p: dict(s) for p, s in opt.state.items()})
        device = [p for g in opt.param_groups for p in g["params"]]
        device += [v for s in opt.state.values() for k, v in s.items() if k not in host_keys and torch.is_tensor(v)]
        before = [t.detach().clone() for t in device]
        step()
        with torch.no_grad():
            for t, b in zip(device, before):
                t.copy_(b)

        def replay():
            live_groups, live_state = opt.param_groups, opt.state
            host = [v for s in state.values() for k, v in s.items() if k in host_keys]
            host_before = [t.clone() for t in host]
            opt.param_groups, opt.state = [dict(g) for g in groups], state
            try:
                step()
            finally:
                opt.param_groups, opt.state = live_groups, live_state
                for t, b in zip(host, host_before):
                    t.copy_(b)

        return replay


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _backward(model: nn.Module, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


OPTIMIZERS = {
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.01, initial_accumulator_value=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}


class Twins:
    """The same model trained twice: the eager step and the graphed one."""

    def __init__(self, make) -> None:
        self.models = [_model(), _model()]
        self.opts = [make(m.parameters()) for m in self.models]
        self.graphed = GraphedOptimizerStep(self.opts[1], FakeGraph(self.opts[1]))
        install([self.graphed])

    def step(self, i: int, before_step=None) -> None:
        for model, opt in zip(self.models, self.opts):
            opt.zero_grad()
            _backward(model, i)
            if before_step is not None:
                before_step(model, opt)
            opt.step()

    def assert_same(self) -> None:
        (a, b), (oa, ob) = self.models, self.opts
        for (name, x), y in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(x, y), f"{name} differs"
        for (pa, sa), (pb, sb) in zip(oa.state.items(), ob.state.items()):
            assert sa.keys() == sb.keys()
            for key in sa:
                assert torch.equal(sa[key], sb[key]), f"state {key} differs: {sa[key]} vs {sb[key]}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_replays_after_warmup_and_equals_the_eager_step(name):
    twins = Twins(OPTIMIZERS[name])
    for i in range(10):
        twins.step(i)
    twins.assert_same()
    g = twins.graphed
    warmup = WARMUP_CALLS + (name == "sgd_momentum")  # the first step creates the momentum buffers
    assert (g.captures, g.eager_calls, g.replays) == (1, warmup, 10 - warmup), g
    if name == "adagrad":
        assert all(int(s["step"]) == 10 for s in twins.opts[1].state.values())


def test_a_new_lr_is_recaptured_and_a_scheduler_ends_in_eager_steps():
    twins = Twins(OPTIMIZERS["adagrad"])
    for i in range(6):
        twins.step(i)
    for opt in twins.opts:
        opt.param_groups[0]["lr"] = 0.02
    for i in range(6, 12):
        twins.step(i)
    twins.assert_same()
    g = twins.graphed
    assert (g.captures, g.changes, g.eager_calls) == (2, 1, 2 * WARMUP_CALLS), g
    with pytest.warns(UserWarning, match=r"Adagrad\) runs eagerly: .*changed 9 times"):
        for i in range(12, 12 + MAX_CHANGES + 3):
            for opt in twins.opts:
                opt.param_groups[0]["lr"] *= 0.9
            twins.step(i)
    twins.assert_same()
    assert g.disabled and g.captures == 2


# A scheduled dense rate (optimizer.dense.schedule) as recpipe.sharding.build.dense_optimizer
# makes it: a 0-dim tensor on the parameters' device, on the torch paths that read it there.
ON_DEVICE = {
    "adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr, weight_decay=0.01, initial_accumulator_value=0.1,
                                                 **({"foreach": True} if torch.is_tensor(lr) else {})),
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, weight_decay=0.01, **({"fused": True} if torch.is_tensor(lr) else {})),
}


@pytest.mark.parametrize("name", sorted(ON_DEVICE))
def test_a_scheduled_rate_on_the_device_is_read_by_every_replay(name):
    """One capture follows a new rate at every step, bit-identical to the eager step with
    the same rates as floats (a torch LRScheduler's way); a rate baked into the graph would
    make every replay train at the captured one."""
    rates = [0.1 * (k + 1) / 12 for k in range(12)]  # a warm-up: a new rate every step
    models = [_model(), _model()]
    lr = torch.tensor(rates[0])
    eager, graphed_opt = ON_DEVICE[name](models[0].parameters(), rates[0]), ON_DEVICE[name](models[1].parameters(), lr)
    graphed = GraphedOptimizerStep(graphed_opt, FakeGraph(graphed_opt))
    install([graphed])
    for i, rate in enumerate(rates):
        eager.param_groups[0]["lr"] = rate
        lr.fill_(rate)
        for model, opt in zip(models, (eager, graphed_opt)):
            opt.zero_grad()
            _backward(model, i)
            opt.step()
    for (key, x), y in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(x, y), f"{key} differs"
    assert (graphed.captures, graphed.changes, graphed.replays) == (1, 0, len(rates) - WARMUP_CALLS), graphed


def test_a_tensor_rate_is_replayed_only_where_torch_reads_it_on_the_device():
    p = [nn.Parameter(torch.zeros(3))]
    assert "foreach SGD reads on the host (alpha=-lr); use fused=True" in unsupported(torch.optim.SGD(p, lr=torch.tensor(0.1)))
    assert "single-tensor step reads on the host" in unsupported(torch.optim.Adagrad(p, lr=torch.tensor(0.1), foreach=False))
    assert "a 0-dim tensor on the parameters' device" in unsupported(torch.optim.SGD(p, lr=torch.tensor(0.1, requires_grad=True), fused=True))
    assert unsupported(torch.optim.SGD(p, lr=torch.tensor(0.1), fused=True)) is None
    assert unsupported(torch.optim.Adagrad(p, lr=torch.tensor(0.1), foreach=True)) is None
    assert "fused=True" in unsupported(torch.optim.Adagrad(p, lr=0.1, fused=True))


def test_load_state_dict_in_place_keeps_the_graph_and_replacing_state_recaptures():
    # torchrec's KeyedOptimizer copies into the live state tensors: the graph stays valid.
    models = [_model(), _model()]
    keyed = [KeyedOptimizerWrapper(dict(m.named_parameters()), OPTIMIZERS["adagrad"]) for m in models]
    (inner,) = torch_optimizers(keyed[1])
    graphed = GraphedOptimizerStep(inner, FakeGraph(inner))
    install([graphed])
    saved = None
    for i in range(8):
        for model, opt in zip(models, keyed):
            opt.zero_grad()
            _backward(model, i)
            opt.step()
        if i == 4:
            saved = [(copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict())) for m, o in zip(models, keyed)]
    for (m_state, o_state), model, opt in zip(saved, models, keyed):
        model.load_state_dict(m_state)
        opt.load_state_dict(o_state)
    for i in range(5, 9):
        for model, opt in zip(models, keyed):
            opt.zero_grad()
            _backward(model, i)
            opt.step()
    assert graphed.captures == 1 and graphed.replays == 8 + 4 - WARMUP_CALLS, graphed
    assert all(int(s["step"]) == 9 for s in inner.state.values())
    for x, y in zip(*(m.parameters() for m in models)):
        assert torch.equal(x, y)
    # torch's own load_state_dict replaces the state tensors: the old graph must not replay.
    twins = Twins(OPTIMIZERS["adagrad"])
    for i in range(5):
        twins.step(i)
    snapshot = [copy.deepcopy(o.state_dict()) for o in twins.opts]
    for i in range(5, 7):
        twins.step(i)
    for opt, state in zip(twins.opts, snapshot):
        opt.load_state_dict(state)
    for i in range(5, 10):
        twins.step(i)
    twins.assert_same()
    assert twins.graphed.captures == 2 and twins.graphed.changes == 1, twins.graphed


def test_moved_or_missing_gradients_and_calls_it_cannot_replay():
    twins = Twins(OPTIMIZERS["sgd_momentum"])

    def fresh_grads(model, opt):  # gradients in new tensors (as semi_sync's stash)
        for p in model.parameters():
            p.grad = p.grad.clone()

    for i in range(6):
        twins.step(i, fresh_grads)
    twins.assert_same()
    replays = twins.graphed.replays
    assert replays == 6 - WARMUP_CALLS - 1

    def no_last_bias_grad(model, opt):
        model[2].bias.grad = None

    twins.step(6, no_last_bias_grad)  # another set of parameters: eager, the graph is dropped
    twins.step(7, fresh_grads)
    # changes: the momentum buffers' creation, the missing gradient, its return
    assert twins.graphed.replays == replays and twins.graphed.changes == 3
    for i in range(8, 12):
        twins.step(i)
    twins.assert_same()
    assert twins.graphed.captures == 2
    # A closure, step hooks: eager.
    g = twins.graphed
    eager = g.eager_calls
    opt = twins.opts[1]
    _backward(twins.models[1], 0)
    opt.step(lambda: None)
    handle = opt.register_step_post_hook(lambda *_: None)
    opt.step()
    handle.remove()
    assert g.eager_calls == eager + 2


def test_optimizers_it_cannot_replay_exactly_are_named_and_stay_eager():
    model = _model()
    cases = {
        "Adam computes its bias corrections on the host": torch.optim.Adam(model.parameters()),
        "lr_decay=0.1": torch.optim.Adagrad(model.parameters(), lr_decay=0.1),
        r"\['momentum'\] are tensors": torch.optim.SGD(model.parameters(), lr=0.1, momentum=torch.tensor(0.9)),
        r"lr is a tensor, which foreach SGD reads on the host": torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1)),
    }
    for needle, opt in cases.items():
        with pytest.warns(UserWarning, match=needle):
            assert graph_steps(opt, torch.device("cpu")) == []
    with pytest.warns(UserWarning, match=r"parameters are on \['cpu'\], not all on cuda:0"):
        assert graph_steps(torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cuda", 0)) == []
    # The pipeline's optimizer: torchrec's wrappers are opened, fused embedding optimizers left out.
    sgd = KeyedOptimizerWrapper(dict(model.named_parameters()), OPTIMIZERS["sgd"])
    combined = CombinedOptimizer([EmptyFusedOptimizer(), ("dense", sgd)])
    (graphed,) = graph_steps(combined, torch.device("cpu"))
    assert graphed.optimizer is sgd._optimizer
    install([graphed])
    assert vars(sgd._optimizer)["step"] is graphed
    remove([graphed])
    assert "step" not in vars(sgd._optimizer)


def test_lr_decay_set_after_construction_is_refused_at_capture():
    twins = Twins(OPTIMIZERS["adagrad"])
    for opt in twins.opts:
        opt.param_groups[0]["lr_decay"] = 0.5
    with pytest.warns(UserWarning, match="lr_decay=0.5"):
        for i in range(5):
            twins.step(i)
    twins.assert_same()
    assert twins.graphed.captures == 0 and twins.graphed.eager_calls == 5


def test_a_failed_capture_is_named_and_leaves_the_step_counts_as_they_were():
    model = _model()
    opt = OPTIMIZERS["adagrad"](model.parameters())

    def broken(step):
        step()  # the host part ran: step counts +1
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed = GraphedOptimizerStep(opt, broken)
    install([graphed])
    for i in range(WARMUP_CALLS):
        _backward(model, i)
        opt.step()
    _backward(model, 9)
    with pytest.raises(PipelineError, match="cannot capture the dense optimizer's step.*cuda_graphs.optimizer=false"):
        opt.step()
    assert all(int(s["step"]) == WARMUP_CALLS for s in opt.state.values())
