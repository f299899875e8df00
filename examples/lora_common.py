"""What the two LoRA examples share: text shipped with Python, a byte-level tokenizer, a
tiny Llama-style model built from a config, its pre-training, LoRA adapters on the last
attention layer, next-token losses, and memory / throughput measurements.

Everything runs offline: the text is the standard library's own (docstrings as prose,
the code itself with the docstrings removed), the tokenizer maps each ASCII byte to its
own id (vocabulary 128, nothing downloaded), and the model starts from a random
initialisation (``LlamaForCausalLM(config)``). Nothing here is part of the library.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 128  # ASCII bytes; anything else becomes "?"

#: standard-library modules whose docstrings (prose) and code make the corpora; a fixed
#: list, so the text is the same wherever Python 3.10+ is installed (up to its version)
MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "dis", "doctest", "email.message", "enum", "filecmp", "fnmatch",
    "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq",
    "hmac", "html.parser", "http.client", "http.cookiejar", "imaplib", "inspect", "ipaddress",
    "json.decoder", "json.encoder", "locale", "logging", "lzma", "mailbox", "mimetypes",
    "numbers", "operator", "optparse", "pathlib", "pdb", "pickle", "pickletools", "platform",
    "poplib", "pprint", "pydoc", "queue", "quopri", "random", "reprlib", "sched", "selectors",
    "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "turtle", "typing", "unittest.case", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom", "zipfile",
)  # fmt: skip


def _ascii(text: str) -> str:
    return "".join(c if ord(c) < VOCAB else "?" for c in text)


def docstrings(modules: Sequence[str] = MODULES) -> list[str]:
    """The docstrings of each module and of its classes, functions and methods (prose)."""
    found: list[str] = []
    seen: set[str] = set()
    # typing's deprecated typing.io/typing.re classes warn when their docs are read;
    # they are read all the same, so the text stays what it was
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in modules:
            try:
                module = importlib.import_module(name)
            except ImportError:  # e.g. turtle without tkinter
                continue
            objects: list[Any] = [module]
            for _, value in sorted(vars(module).items()):
                if getattr(value, "__module__", None) != module.__name__:
                    continue
                objects.append(value)
                if inspect.isclass(value):
                    objects.extend(member for _, member in sorted(vars(value).items()))
            for obj in objects:
                doc = getattr(obj, "__doc__", None)
                if isinstance(doc, str) and len(doc) > 40 and doc not in seen:
                    seen.add(doc)
                    found.append(_ascii(inspect.cleandoc(doc)))
    return found


def source_code(modules: Sequence[str] = MODULES) -> list[str]:
    """Each module's code with its docstrings and comments removed (``ast.unparse``)."""
    found: list[str] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
            tree = ast.parse(inspect.getsource(module))
        except (ImportError, OSError, TypeError):
            continue
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (
                isinstance(body, list)
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                body[0] = ast.Pass()
        found.append(_ascii(ast.unparse(tree)))
    return found


def encode(text: str) -> Tensor:
    """Byte-level token ids (int64), one per ASCII character."""
    return torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()


def windows(texts: Iterable[str], length: int) -> Tensor:
    """Non-overlapping windows of ``length`` tokens over the joined texts, ``[n, length]``."""
    ids = encode("\n\n".join(texts))
    count = len(ids) // length
    return ids[: count * length].reshape(count, length)


@dataclass
class Corpus:
    """Token windows: pre-training, fine-tuning and test prose, and code (out of domain)."""

    pretrain: Tensor
    finetune: Tensor
    test: Tensor
    code: Tensor


def corpus(length: int, *, seed: int, sizes: tuple[int, int, int, int]) -> Corpus:
    """Shuffled docstring windows split into pretrain / finetune / test, and code windows.

    The docstrings are split by document (module order shuffled with ``seed``) before
    cutting windows, so test prose comes from docstrings the model never trained on.

    Args:
        length: tokens per window.
        seed: the shuffle.
        sizes: windows kept for (pretrain, finetune, test, code).
    """
    generator = torch.Generator().manual_seed(seed)
    docs = docstrings()
    order = torch.randperm(len(docs), generator=generator).tolist()
    docs = [docs[i] for i in order]
    test_docs = docs[: len(docs) // 5]
    train_docs = docs[len(docs) // 5 :]
    train = windows(train_docs, length)
    train = train[torch.randperm(len(train), generator=generator)]
    test = windows(test_docs, length)
    test = test[torch.randperm(len(test), generator=generator)]
    code = windows(source_code(), length)
    code = code[torch.randperm(len(code), generator=generator)]
    n_pre, n_fine, n_test, n_code = sizes
    if n_pre + n_fine > len(train) or n_test > len(test) or n_code > len(code):
        raise ValueError(f"not enough text for sizes {sizes}")
    return Corpus(train[:n_pre], train[n_pre : n_pre + n_fine], test[:n_test], code[:n_code])


def tiny_llama(*, hidden: int, layers: int, heads: int, length: int, seed: int) -> nn.Module:
    """A Llama-style causal LM from a config (random init, no download), eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=length,
        use_cache=False,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def next_token_nll(logits: Tensor, ids: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of each next token: mean (default) or per token ``[B, T-1]``."""
    losses = F.cross_entropy(logits[..., :-1, :].transpose(1, -1), ids[..., 1:], reduction="none")
    return losses.mean() if reduction == "mean" else losses


def logits_of(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids).logits


def pretrain(
    model: nn.Module, data: Tensor, *, steps: int, batch: int, lr: float, seed: int
) -> list[float]:
    """AdamW on next-token prediction (cosine-decayed lr); returns the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        rows = torch.randint(0, len(data), (batch,), generator=generator)
        ids = data[rows]
        loss = next_token_nll(logits_of(model, ids), ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses


def lora_config(layer: int, rank: int) -> Any:
    """LoRA on the attention projections of one layer (the last, in the examples)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        layers_to_transform=[layer],
    )


def with_lora(base: nn.Module, layer: int, rank: int, b_std: float = 0.0) -> nn.Module:
    """A PEFT model around a deep copy of ``base`` (``base`` itself is left alone).

    PEFT draws ``lora_A`` (Kaiming-uniform) and sets ``lora_B = 0``; ``b_std > 0`` draws
    ``lora_B`` from N(0, b_std^2) too (from torch's global RNG), so that models started
    from different seeds differ in their update ``B A`` from the start.
    """
    from peft import get_peft_model

    model = get_peft_model(copy.deepcopy(base), lora_config(layer, rank))
    if b_std > 0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, b_std)
    return model


def adapters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------------- measurements
def resident_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of distinct storages among ``tensors`` (shared storages counted once)."""
    storages: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def state_tensors(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every parameter, buffer, gradient and optimizer-state tensor (what a run keeps)."""
    found: list[Tensor] = []
    for module in modules:
        found.extend(module.parameters())
        found.extend(module.buffers())
        found.extend(p.grad for p in module.parameters() if p.grad is not None)
    for state in optimizer.state.values():
        found.extend(v for v in state.values() if isinstance(v, Tensor) and v.dim() > 0)
    return found


def transient_peak_bytes(run: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated during ``run()`` above what was allocated before it.

    CUDA: the caching allocator's peak counter. CPU: the torch profiler's running sum of
    every op's allocations and frees (tracemalloc cannot see torch's allocations).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def median_seconds(run: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median wall time of ``run()`` over ``repeats`` calls (after one warm-up call)."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def auroc(negatives: Tensor, positives: Tensor) -> float:
    """P(score of a positive > score of a negative), ties counted half (Mann-Whitney)."""
    diff = positives.reshape(-1, 1) - negatives.reshape(1, -1)
    return float((diff > 0).double().mean() + 0.5 * (diff == 0).double().mean())


# ---------------------------------------------------------------------- text episodes
def reference_text() -> list[str]:
    """The Python language reference shipped for ``help()`` (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    return [_ascii(topics[key]) for key in sorted(topics)]


def unicode_names() -> list[str]:
    """Unicode character names, one per line ("LATIN SMALL LETTER A", ...)."""
    import unicodedata

    names = (unicodedata.name(chr(code), "") for code in range(0x20, 0x30000))
    return ["\n".join(name for name in names if name)]


def codec_tables() -> list[str]:
    """The code of the standard library's single-byte codecs: their mapping tables."""
    codecs = ("cp437", "cp850", "cp852", "cp1250", "cp1251", "cp1252", "mac_roman", "koi8_r")
    return source_code([f"encodings.{name}" for name in codecs])


#: the continual example's episodes, in order: name -> texts
EPISODES: dict[str, Callable[[], list[str]]] = {
    "reference": reference_text,
    "code": source_code,
    "unicode names": unicode_names,
    "codec tables": codec_tables,
}


def episode_windows(
    name: str, length: int, *, train: int, test: int, seed: int
) -> tuple[Tensor, Tensor]:
    """Disjoint random train and test windows of one episode's text."""
    data = windows(EPISODES[name](), length)
    data = data[torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))]
    if train + test > len(data):
        raise ValueError(f"episode {name!r} has {len(data)} windows (asked {train + test})")
    return data[:train], data[train : train + test]
