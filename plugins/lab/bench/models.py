"""The methods and models the benchmark times: every method gets its own copy of the same
model (same initialization) and the same fixed batch."""

from __future__ import annotations

from typing import Any, Dict

import torch

import plugins

RHO = 0.1
THETA = 0.4
P_EFFICIENT = 0.5
BASE_KW = dict(lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=1e-4)

# name -> (label, wrapper class name or None for the base, keyword arguments)
METHODS: Dict[str, tuple] = {
    "adamw": ("AdamW", None, {}),
    "sam": ("SAM", "SAM", {"rho": RHO}),
    "vasso": ("VASSO", "VASSO", {"rho": RHO, "theta": THETA}),
    "evasso": (f"eVASSO(p={P_EFFICIENT:g})", "VASSO", {"rho": RHO, "theta": THETA, "p": P_EFFICIENT}),
}
# the floor of the per-step overhead: AdamW running the same two forward/backward passes as
# SAM and VASSO (timed against them only, on FLOOR_MODEL)
FLOOR_METHODS = {"adamw-2pass": ("AdamW, two passes", None, {})}
# SAM and VASSO whose closure scales the loss with a torch.amp.GradScaler (fp32 model: only the
# scaler's own work differs), timed against the same methods unscaled
SCALED_METHODS = {"sam-scaled": ("SAM + GradScaler", "SAM", {"rho": RHO}),
                  "vasso-scaled": ("VASSO + GradScaler", "VASSO", {"rho": RHO, "theta": THETA})}
# state only (no timing): eVASSO without the stability diagnostic's buffer
STATE_ONLY = {
    "evasso-nostab": (f"eVASSO(p={P_EFFICIENT:g}, track_stability=False)", "VASSO",
                      {"rho": RHO, "theta": THETA, "p": P_EFFICIENT, "track_stability": False}),
}


MODELS: Dict[str, Dict[str, Any]] = {
    "transformer": dict(kind="transformer", vocab=2000, d=256, layers=2, heads=4, ff=1024, batch=16, seq=32,
                        dropout=0.1),
    "many-small": dict(kind="many-small", blocks=150, width=32, batch=64),
}
# 30 x [Linear(32, 32), LayerNorm(32)], no head: 120 small tensors, where the wrapper's per-step
# bookkeeping shows against AdamW with the same two passes (the benchmark's floor targets)
FLOOR_MODEL: Dict[str, Any] = dict(kind="many-small", blocks=30, width=32, batch=64, head=False)
TINY_FLOOR_MODEL: Dict[str, Any] = dict(kind="many-small", blocks=3, width=4, batch=3, head=False)
# for the tests: seconds, not minutes
TINY_MODELS: Dict[str, Dict[str, Any]] = {
    "transformer": dict(kind="transformer", vocab=50, d=16, layers=1, heads=2, ff=32, batch=2, seq=5, dropout=0.1),
    "many-small": dict(kind="many-small", blocks=4, width=4, batch=3),
}


class TinyTransformerLM(torch.nn.Module):
    """Token embedding + positional embedding + pre-norm transformer encoder layers
    (causal mask) + tied output projection; cross-entropy on the next token."""

    def __init__(self, vocab, d, layers, heads, ff, seq, dropout, **_):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.norm(h) @ self.embed.weight.t()


class ManySmall(torch.nn.Module):
    """A deep residual stack of tiny Linear + LayerNorm blocks: 4 tensors per block."""

    def __init__(self, blocks, width, head=True, **_):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width)) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 10) if head else torch.nn.Identity()  # without: width classes

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def build(model_cfg: Dict[str, Any], seed: int = 0, device: str = "cpu"):
    """(model, loss_fn) with a fixed batch; the same seed gives the same weights and batch
    (drawn on the CPU, then moved to ``device``)."""
    torch.manual_seed(seed)
    if model_cfg["kind"] == "transformer":
        model = TinyTransformerLM(**model_cfg)
        g = torch.Generator().manual_seed(seed + 1)
        tokens = torch.randint(0, model_cfg["vocab"], (model_cfg["batch"], model_cfg["seq"] + 1), generator=g)
        model.to(device)
        tokens = tokens.to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        def loss_fn():
            logits = model(inputs)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    elif model_cfg["kind"] == "many-small":
        model = ManySmall(**model_cfg)
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(model_cfg["batch"], model_cfg["width"], generator=g)
        y = torch.randint(0, min(10, model_cfg["width"]), (model_cfg["batch"],), generator=g)
        model.to(device)
        x, y = x.to(device), y.to(device)

        def loss_fn():
            return torch.nn.functional.cross_entropy(model(x), y)
    else:
        raise ValueError(f"unknown model kind {model_cfg['kind']!r}")
    model.train()
    return model, loss_fn


def make_scaler(method: str):
    """A CPU ``torch.amp.GradScaler`` for the ``*-scaled`` methods (None for the others);
    torch < 2.3 has none for the CPU: RuntimeError."""
    if method not in SCALED_METHODS:
        return None
    if not hasattr(torch.amp, "GradScaler"):
        raise RuntimeError(f"torch {torch.__version__} has no CPU GradScaler (torch.amp.GradScaler('cpu'), torch >= 2.3)")
    return torch.amp.GradScaler("cpu")


def make_optimizer(method: str, model: torch.nn.Module):
    label, cls_name, kw = {**METHODS, **STATE_ONLY, **FLOOR_METHODS, **SCALED_METHODS}[method]
    if cls_name is None:
        return torch.optim.AdamW(model.parameters(), **BASE_KW)
    return getattr(plugins, cls_name)(model.parameters(), torch.optim.AdamW, **kw, **BASE_KW)


def tensor_bytes(obj) -> int:
    """Bytes of every tensor inside nested dicts/lists/tuples."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def state_bytes(opt, model) -> Dict[str, int]:
    """Parameter bytes, the base optimizer's state bytes and the wrapper's own."""
    param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
    base = getattr(opt, "base_optimizer", opt)
    base_bytes = sum(tensor_bytes(s) for s in base.state.values())
    extra = opt.state_nbytes(include_scratch=True) if hasattr(opt, "state_nbytes") else 0
    return {"param_bytes": param_bytes, "base_state_bytes": base_bytes, "extra_state_bytes": extra}


def model_info(cfgs: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
    info = {}
    for md, cfg in cfgs.items():
        model, _ = build(cfg)
        ps = list(model.parameters())
        info[md] = f"{sum(q.numel() for q in ps) / 1e6:.2f} M parameters in {len(ps)} tensors"
    return info
