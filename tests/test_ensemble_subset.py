"""ParallelEnsemble over a subset of the parameters (LoRA-style), and its loop fallback.

What is checked:
- a subset ensemble (K stacked copies of the chosen tensors, the rest shared) computes,
  and under SGD trains, exactly what K independent models do: plain modules and a
  PEFT-wrapped HF Llama built from a config (float64: equal to rounding, see below);
- memory: the ensemble holds the base once (the module's own tensors, not copies) plus
  K times the subset, byte for byte, and layers before the first stacked tensor run
  unbatched (once for all members);
- the loop fallback: backend="loop" gives vmap's numbers (outputs, gradients, BatchNorm
  statistics), "auto" falls back on a model vmap cannot trace with one warning and K
  independent models' numbers, "vmap" raises vmap's error, randomness "same"/"different";
- every error message of the new arguments.

Tolerances: float64 throughout where results are compared; the only difference between
the ensemble and K separate models is the order in which batched kernels accumulate, a
relative error of a few ulps per operation, so 1e-12 (relative) bounds it with margin
for these sizes (tens of operations of depth, sums of at most a few hundred terms).
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from samplers_as_optim import SGHMC
from samplers_as_optim.samples.ensemble import ParallelEnsemble

K = 3
TOL = {"rtol": 1e-12, "atol": 1e-12}


def trunk_and_head() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def frozen_trunk(device, seed=0) -> nn.Sequential:
    torch.manual_seed(seed)
    net = trunk_and_head().double().to(device)
    for name, param in net.named_parameters():
        param.requires_grad_(name.startswith("4."))
    return net


def unique_bytes(module: nn.Module) -> int:
    seen = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


# ---------------------------------------------------------------------- plain modules
@pytest.mark.parametrize("backend", ["auto", "loop"])
def test_subset_ensemble_trains_like_k_independent_models(device, backend):
    base = frozen_trunk(device)
    models = []
    for k in range(K):
        model = copy.deepcopy(base)
        with torch.no_grad():
            model[4].weight.normal_(generator=torch.Generator(device).manual_seed(k))
        models.append(model)
    ensemble = ParallelEnsemble.from_modules(models, subset="trainable", backend=backend)
    assert list(ensemble.stacked()) == ["4.weight", "4.bias"]
    assert ensemble.stacked()["4.weight"].shape == (K, 3, 8)
    assert ensemble.module[0].weight is models[0][0].weight  # shared, not copied

    optimizer = torch.optim.SGD([p for p in ensemble.parameters() if p.requires_grad], lr=0.1)
    singles = [torch.optim.SGD([m[4].weight, m[4].bias], lr=0.1) for m in models]
    torch.manual_seed(1)
    for _ in range(5):
        x = torch.randn(7, 5, dtype=torch.float64, device=device)
        y = torch.randint(0, 3, (7,), device=device)
        optimizer.zero_grad()
        ensemble.loss(F.cross_entropy, ensemble(x), y).backward()
        optimizer.step()
        for model, single in zip(models, singles, strict=True):
            single.zero_grad()
            F.cross_entropy(model(x), y).backward()
            single.step()
    for k, model in enumerate(models):
        assert_close(ensemble.stacked()["4.weight"][k], model[4].weight.detach(), **TOL)
        assert_close(ensemble.stacked()["4.bias"][k], model[4].bias.detach(), **TOL)
    # the shared trunk is frozen: no gradient reaches it
    assert ensemble.module[0].weight.grad is None


def test_module_with_subset_starts_every_member_from_its_values_and_shares_the_rest(device):
    base = frozen_trunk(device)
    before = copy.deepcopy(base)
    ensemble = ParallelEnsemble(base, K, subset=["2.weight", "4.bias"], seed=0)
    assert list(ensemble.stacked()) == ["2.weight", "4.bias"]
    for k in range(K):
        assert torch.equal(ensemble.stacked()["2.weight"][k], base[2].weight)
    # the module is not modified and its other tensors are the ensemble's
    for (name, got), (_, want) in zip(
        base.named_parameters(), before.named_parameters(), strict=True
    ):
        assert torch.equal(got, want), name
    assert ensemble.module[4].weight is base[4].weight
    member = ensemble.member(1)
    assert member[4].weight is base[4].weight  # shared base
    assert member[2].weight.shape == (8, 16) and member[2].weight is not base[2].weight
    assert "subset=<2 tensors>" in repr(ensemble)
    # a predicate picks the same tensors
    by_predicate = ParallelEnsemble(base, K, subset=lambda n, t: n in ("2.weight", "4.bias"))
    assert list(by_predicate.stacked()) == ["2.weight", "4.bias"]


def test_factory_with_subset_draws_each_members_subset_under_its_seed(device):
    base = frozen_trunk(device)

    def factory():
        model = copy.deepcopy(base)
        nn.init.normal_(model[4].weight)
        return model

    ensemble = ParallelEnsemble(factory, K, subset="trainable", seed=5)
    weights = ensemble.stacked()["4.weight"]
    assert not torch.equal(weights[0], weights[1])
    again = ParallelEnsemble(factory, K, subset="trainable", seed=5)
    assert torch.equal(again.stacked()["4.weight"], weights)


def test_memory_is_the_base_once_plus_k_subsets(device):
    base = frozen_trunk(device)
    subset_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    for members in (1, 4, 16):
        ensemble = ParallelEnsemble(base, members, subset="trainable")
        # the base's frozen tensors (shared) and K stacked subsets: the module's own
        # subset is not among them
        assert unique_bytes(ensemble) == unique_bytes(base) + (members - 1) * subset_bytes


def test_layers_before_the_subset_run_once_for_all_members(device):
    from torch._C._functorch import is_batchedtensor

    base = frozen_trunk(device)
    ensemble = ParallelEnsemble(base, K, subset="trainable")
    batched = {}

    def record(name):
        def hook(module, inputs, output):
            batched[name] = is_batchedtensor(output)

        return hook

    for index in (0, 2, 4):
        ensemble.module[index].register_forward_hook(record(index))
    ensemble(torch.randn(2, 5, dtype=torch.float64, device=device))
    assert batched == {0: False, 2: False, 4: True}


def test_chunked_backward_with_a_subset_gives_the_same_gradients(device):
    base = frozen_trunk(device)
    ensemble = ParallelEnsemble(base, 4, subset="trainable")
    with torch.no_grad():
        ensemble.stacked()["4.weight"].normal_(generator=torch.Generator(device).manual_seed(0))
    x = torch.randn(6, 5, dtype=torch.float64, device=device)
    y = torch.randint(0, 3, (6,), device=device)
    ensemble.backward(F.cross_entropy, x, targets=y)
    full = ensemble.stacked()["4.weight"].grad.clone()
    ensemble.zero_grad()
    ensemble.backward(F.cross_entropy, x, targets=y, chunk_size=3)
    assert_close(ensemble.stacked()["4.weight"].grad, full, **TOL)


# ---------------------------------------------------------------------- HF + PEFT
def tiny_peft_llama(device):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).double().to(device)
    lora = peft.LoraConfig(
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "v_proj"],
        layers_to_transform=[1],
        init_lora_weights="gaussian",  # B != 0, so each member's adapters matter
    )
    return base, lora, peft


def test_peft_llama_subset_ensemble_equals_k_peft_models(device):
    base, lora, peft = tiny_peft_llama(device)

    def factory():
        model = peft.get_peft_model(copy.deepcopy(base), lora)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.1)
        return model

    ensemble = ParallelEnsemble(factory, K, subset="trainable", seed=0)
    names = list(ensemble.stacked())
    assert len(names) == 4 and all("layers.1.self_attn" in n and "lora_" in n for n in names)
    models = ensemble.members()
    # K x adapters, the base once
    adapter_bytes = sum(p.numel() * 8 for p in models[0].parameters() if p.requires_grad)
    base_bytes = unique_bytes(models[0]) - adapter_bytes
    assert unique_bytes(ensemble) == base_bytes + K * adapter_bytes

    trainable = [p for p in ensemble.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    singles = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in models
    ]

    def next_token_loss(logits, ids):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    torch.manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 40, (2, 12), device=device)
        optimizer.zero_grad()
        logits = ensemble(ids).logits
        assert logits.shape == (K, 2, 12, 40)
        ensemble.loss(next_token_loss, logits, ids).backward()
        optimizer.step()
        for model, single in zip(models, singles, strict=True):
            single.zero_grad()
            next_token_loss(model(ids).logits, ids).backward()
            single.step()
    for k, model in enumerate(models):
        own = dict(model.named_parameters())
        for name, stacked in ensemble.stacked().items():
            assert_close(stacked[k], own[name].detach(), **TOL)


def test_peft_llama_under_sghmc_and_the_loop_backend_agree(device):
    base, lora, peft = tiny_peft_llama(device)
    model = peft.get_peft_model(base, lora)
    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0)).to(device)
    results = {}
    for backend in ("vmap", "loop"):
        ensemble = ParallelEnsemble(model, K, subset="trainable", backend=backend)
        optimizer = SGHMC(
            [p for p in ensemble.parameters() if p.requires_grad], lr=1e-3, num_data=100, seed=0
        )
        for _ in range(3):
            optimizer.zero_grad()
            logits = ensemble(ids).logits
            loss = ensemble.loss(
                lambda o, t: F.cross_entropy(o[:, :-1].flatten(0, 1), t[:, 1:].flatten()),
                logits,
                ids,
            )
            loss.backward()
            optimizer.step()
        results[backend] = {n: t.detach().clone() for n, t in ensemble.stacked().items()}
    for name, value in results["vmap"].items():
        assert_close(results["loop"][name], value, **TOL)
    # the noise separates members that started equal
    first = next(iter(results["vmap"].values()))
    assert not torch.equal(first[0], first[1])


# ---------------------------------------------------------------------- the loop fallback
class DataDependent(nn.Module):
    """A model vmap cannot trace: Python control flow on a member's own values."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.inner(x)
        if h.abs().max().item() > 1.0:  # .item() of a batched tensor: vmap refuses
            h = h / h.abs().max()
        return self.head(torch.tanh(h))


def test_auto_falls_back_to_a_loop_once_with_the_numbers_of_k_models(device):
    torch.manual_seed(0)
    models = [DataDependent().double().to(device) for _ in range(K)]
    ensemble = ParallelEnsemble.from_modules(models)
    x = 3 * torch.randn(5, 4, dtype=torch.float64, device=device)
    y = torch.tensor([0, 1, 1, 0, 1], device=device)
    with pytest.warns(RuntimeWarning, match=r"torch.func.vmap cannot run DataDependent .*one"):
        outputs = ensemble(x)
    ensemble.loss(F.cross_entropy, outputs, y).backward()
    for k, model in enumerate(models):
        assert_close(outputs[k], model(x), **TOL)
        F.cross_entropy(model(x), y).backward()
        assert_close(ensemble.stacked()["inner.weight"].grad[k], model.inner.weight.grad, **TOL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        again = ensemble(x, per_member_inputs=False)
        chunked = ensemble.backward(F.cross_entropy, x, targets=y, chunk_size=2)
    assert_close(again, outputs, **TOL)
    assert chunked.shape == ()
    forced = ParallelEnsemble.from_modules(models, backend="vmap")
    with pytest.raises(RuntimeError, match=r"item"):
        forced(x)


def test_loop_backend_gives_vmaps_outputs_gradients_and_statistics(device):
    torch.manual_seed(0)

    def factory():
        return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))

    outputs, grads, stats = {}, {}, {}
    for backend in ("vmap", "loop"):
        ensemble = ParallelEnsemble(factory, K, seed=3, backend=backend).double().to(device)
        x = torch.linspace(-2, 2, K * 8 * 5, dtype=torch.float64, device=device).reshape(K, 8, 5)
        out = ensemble(x, per_member_inputs=True)
        out.square().sum().backward()
        outputs[backend] = out.detach()
        grads[backend] = ensemble.stacked()["0.weight"].grad.clone()
        stats[backend] = ensemble.stacked()["1.running_var"].clone()
    assert_close(outputs["loop"], outputs["vmap"], **TOL)
    assert_close(grads["loop"], grads["vmap"], **TOL)
    assert_close(stats["loop"], stats["vmap"], **TOL)
    assert not torch.equal(stats["loop"][0], stats["loop"][1])  # each member's own


def test_loop_backend_randomness(device):
    net = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5))
    x = torch.ones(1, 4, device=device)
    different = ParallelEnsemble.from_modules([net] * 2, backend="loop").to(device)(x)
    assert not torch.equal(different[0] != 0, different[1] != 0)
    same = ParallelEnsemble.from_modules([net] * 2, backend="loop", randomness="same").to(device)
    out = same(x)
    assert torch.equal(out[0], out[1])


def test_subset_and_backend_error_messages():
    net = trunk_and_head()
    with pytest.raises(ValueError, match=r"Invalid subset: 'lora' \(expected 'trainable', a"):
        ParallelEnsemble(net, 2, subset="lora")
    with pytest.raises(ValueError, match=r"Invalid subset: 3 \(expected 'trainable'"):
        ParallelEnsemble(net, 2, subset=3)
    with pytest.raises(ValueError, match=r"Invalid subset: names \['9.weight'\] are not param"):
        ParallelEnsemble(net, 2, subset=["0.weight", "9.weight"])
    with pytest.raises(ValueError, match=r"Invalid subset: <function .*selects no parameter"):
        ParallelEnsemble(net, 2, subset=lambda name, tensor: False)
    with pytest.raises(ValueError, match=r"Invalid backend: 'jit' \(expected one of"):
        ParallelEnsemble(net, 2, backend="jit")
    with pytest.raises(ValueError, match=r"Invalid backend: 'jit' \(expected one of"):
        ParallelEnsemble.from_modules([net], backend="jit")
    with pytest.raises(
        ValueError,
        match=r"Invalid module_or_factory: member 1 has '0.weight', outside the subset, "
        r"different from member 0's",
    ):
        ParallelEnsemble(trunk_and_head, 2, subset=["4.weight"])
    with pytest.raises(ValueError, match=r"Invalid modules: member 1 has '0.bias', outside"):
        ParallelEnsemble.from_modules([net, trunk_and_head()], subset=["0.weight"])


def test_samples_of_a_subset_ensemble_have_one_layout_and_evaluate_as_the_members(device):
    """Collected with a subset, every recorded name is ``[S, K, ...]``: a trained weight
    outside the subset and the shared BatchNorm statistics are repeated along K (recorded
    ``[S, ...]`` they would be misread after flattening, silently where their first
    dimension happens to be K). Flattened to S * K draws, each sample evaluates to the
    ensemble's output for that member at that step."""
    from samplers_as_optim import RunningMoments, SampleCollector, call_stacked

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, K), nn.BatchNorm1d(K), nn.Tanh(), nn.Linear(K, 2))
    base = base.double().to(device)
    ensemble = ParallelEnsemble(base, K, subset=["3.weight", "3.bias"])
    opt = SGHMC(ensemble.parameters(), lr=1e-3, num_data=32, seed=0)
    collector = SampleCollector(ensemble, 4)
    moments = RunningMoments(ensemble)
    x = torch.randn(32, 5, dtype=torch.float64, device=device)
    y = torch.randint(0, 2, (32,), device=device)
    outputs = []
    for _ in range(4):
        opt.zero_grad()
        ensemble.train()
        F.cross_entropy(ensemble(x).flatten(0, 1), y.repeat(K)).backward()
        opt.step()
        collector.step()
        moments.step()
        ensemble.eval()
        with torch.no_grad():
            outputs.append(ensemble(x))  # [K, 32, 2]
    samples = collector.samples
    assert set(samples) >= {"0.weight", "1.running_mean", "3.weight"}
    for name, tensor in samples.items():
        assert tensor.shape[:2] == (4, K), name
    assert torch.equal(samples["0.weight"][:, 0], samples["0.weight"][:, 1])  # shared
    assert all(tensor.shape[0] == K for tensor in moments.mean.values())
    flat = {name: tensor.flatten(0, 1).to(device) for name, tensor in samples.items()}
    base.eval()
    with torch.no_grad():
        predicted = call_stacked(base, flat, x).view(4, K, 32, 2)
    assert_close(predicted, torch.stack(outputs), **TOL)
