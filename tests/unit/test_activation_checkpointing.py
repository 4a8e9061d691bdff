"""Activation checkpointing of repeated blocks, in one process: which blocks, what is kept for
backward under each policy, and gradients equal to no checkpointing."""

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from autotuner.runtime.training.activation_checkpointing import apply_activation_checkpointing, repeated_blocks


class Block(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Tower(nn.Module):
    def __init__(self, depth: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LiveOutputs(TorchDispatchMode):
    """Every tensor an op creates, weakly: what is still alive after forward is what autograd (or a
    checkpoint's cache) keeps for backward, plus the output."""

    def __init__(self):
        super().__init__()
        self.created: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.created.append(weakref.ref(tensor))
        return out

    def live_bytes(self) -> int:
        storages = {}
        for ref in self.created:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def kept_bytes_and_grads(policy: str) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Tower()
    apply_activation_checkpointing(model, policy)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with LiveOutputs() as tracker:
        loss = model(x).square().mean()
    gc.collect()
    kept = tracker.live_bytes()
    loss.backward()
    return kept, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_full_keeps_least_selective_keeps_the_matmuls_and_gradients_equal_no_checkpointing():
    kept = {}
    grads = {}
    for policy in ("none", "full", "selective"):
        kept[policy], grads[policy] = kept_bytes_and_grads(policy)
    assert kept["full"] < kept["selective"] < kept["none"], kept
    for policy in ("full", "selective"):
        assert grads[policy].keys() == grads["none"].keys()  # parameter names unchanged
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads[policy][name], grad, rtol=0, atol=1e-6, msg=f"{policy} {name}")


def test_the_blocks_are_the_outermost_module_list_entries():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.stages = nn.ModuleList(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)] * 2)) for _ in range(3))

    model = Nested()
    assert repeated_blocks(model) == list(model.stages)
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2))) == []


def test_a_model_without_repeated_blocks_trains_as_it_is_with_one_line(capsys):
    assert apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), "full") == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'activation_checkpointing.policy "full": the model has no repeated blocks' in err


def test_none_touches_nothing_and_an_unknown_policy_is_refused():
    model = Tower()
    assert apply_activation_checkpointing(model, "none") == 0
    assert apply_activation_checkpointing(model, "full") == 4
    with pytest.raises(ValueError):
        apply_activation_checkpointing(Tower(), "every_other")


def test_one_forward_without_checkpointing_tells_what_each_policy_holds():
    """The profile's probe, run once with no checkpointing, against what each policy really keeps
    alive after its forward (the output and a few views aside)."""
    from autotuner.runtime.measure.profile import ActivationProbe

    torch.manual_seed(0)
    model = Tower()
    probe = ActivationProbe(list(model.parameters()), repeated_blocks(model))
    probe.start()
    model(torch.randn(64, 8, generator=torch.Generator().manual_seed(1))).square().mean()
    probe.stop()
    held, peak = probe.held_by_policy(), probe.bytes_by_policy()
    assert held["none"] == peak["none"] == probe.bytes_saved
    assert held["full"] < held["selective"] < held["none"]
    assert held["full"] < peak["full"] < peak["selective"] < peak["none"]  # one block recomputed at a time
    for policy in ("full", "selective"):
        live, _ = kept_bytes_and_grads(policy)
        assert held[policy] == pytest.approx(live, rel=0.15), (policy, held[policy], live)


def test_the_probe_without_blocks_says_nothing_of_policies():
    from autotuner.runtime.measure.profile import ActivationProbe

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    probe = ActivationProbe(list(model.parameters()))
    probe.start()
    model(torch.randn(2, 4)).sum()
    probe.stop()
    assert probe.bytes_saved > 0 and probe.held_by_policy() == {} == probe.bytes_by_policy()


def test_the_probe_leaves_no_graph_behind_a_retained_backward_and_the_gradients_alone():
    """A pipeline stage's backward retains its graph (torch's input-gradient pass); a saved output
    the probe handed back as itself would hold its node in a cycle past the step (one more
    micro-batch of activations in a profile launch's peak, until the collector runs)."""
    from autotuner.runtime.measure.profile import ActivationProbe

    def step(probed: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Sigmoid(), nn.Linear(64, 64), nn.Tanh())  # both save their outputs
        probe = ActivationProbe(list(model.parameters()))
        if probed:
            probe.start()
        out = model(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)))
        probe.stop()
        torch.autograd.backward(out.exp().sum(), retain_graph=True)
        return weakref.ref(out), [p.grad.clone() for p in model.parameters()], probe.bytes_saved

    enabled = gc.isenabled()
    gc.disable()
    try:
        left, probed_grads, saved = step(True)
        assert saved > 0 and left() is None, "the probed forward's output outlived its step"
    finally:
        if enabled:
            gc.enable()
    _, plain_grads, _ = step(False)
    assert all(torch.equal(a, b) for a, b in zip(probed_grads, plain_grads))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_hugging_face_model_trains_alike_under_each_policy_with_its_cache_turned_off(policy):
    """GPT-2's forward writes a key/value cache when config.use_cache is on (its default): the
    recompute then ran other ops than the forward, and selective checkpointing failed in backward
    ("aten.slice.Tensor encountered during backward but not found in storage")."""
    transformers = pytest.importorskip("transformers")

    def gradients(checkpointing: str):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        apply_activation_checkpointing(model, checkpointing)
        tokens = torch.randint(0, 256, (2, 32))
        model(input_ids=tokens, labels=tokens).loss.backward()
        return model, torch.cat([p.grad.flatten() for p in model.parameters()])

    _, expected = gradients("none")
    model, got = gradients(policy)
    assert model.config.use_cache is False
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
