"""Models for the capture / replay tests and the CLI (``--model tests.capture_models:drop_net``)."""
import torch
from torch import nn

POISON = 3e38  # finite in float32; dropout's 1 / (1 - p) = 2 scaling turns it into +inf when kept


class DropNet(nn.Module):
    """NaN only when dropout *keeps* the poisoned element: 2 * 3e38 = inf, sin(inf) = NaN."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.act = Sine()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.act(self.drop(x)))


class Sine(nn.Module):
    def forward(self, x):
        return torch.sin(x)


def drop_net():
    torch.manual_seed(0)
    return DropNet(), lambda model, batch: model(batch).pow(2).mean()


class LogNet(nn.Module):
    """A functional fault inside a module: log of a negative in ``block``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.block = LogBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


class LogBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.log(self.lin(x) - 100.0)


def log_net():
    torch.manual_seed(0)
    return LogNet()


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention. ``mask``: ``"fill"`` fills the scores of future positions with -inf
    (``att.masked_fill(~mask, -inf).softmax(-1)``); ``"inplace"`` fills a view of the scores in place
    (``masked_fill_``: the softmax reads the base tensor, written through the view); ``"additive"``
    adds the model's float -inf mask, made once before the first block as HF does; ``"sdpa"``
    passes that mask to ``scaled_dot_product_attention``. The -inf is intended: softmax turns it
    into 0, so it never reaches the step's result -- unless a NaN from elsewhere meets it in the
    same tensor."""

    def __init__(self, d: int, heads: int, block_size: int, mask: str = "fill"):
        super().__init__()
        self.heads, self.mask = heads, mask
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)))

    def forward(self, x, float_mask=None):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.mask == "sdpa":
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=float_mask.to(q.dtype))
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
            if self.mask == "fill":
                att = att.masked_fill(~self.bias[:t, :t], float("-inf"))
            elif self.mask == "inplace":
                att.view(b * self.heads, t, t).masked_fill_(~self.bias[:t, :t], float("-inf"))
            else:
                att = att + float_mask
            y = att.softmax(-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, block_size: int, mask: str = "fill"):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, block_size, mask)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x, float_mask=None):
        x = x + self.attn(self.ln1(x), float_mask)
        return x + self.mlp(self.ln2(x))


class CausalMask(nn.Module):
    """The float causal mask (0 on and below the diagonal, -inf above), made once per forward
    before the first block, as HF builds its masks: watch it with ``allow=("causal_mask",)``."""

    def forward(self, idx):
        t = idx.shape[1]
        return torch.full((t, t), float("-inf"), device=idx.device).triu(1)


class NanoGPT(nn.Module):
    """A nanoGPT-style language model: ``model(idx, targets) -> (logits, loss)``."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 3, block_size: int = 16,
                 mask: str = "fill"):
        super().__init__()
        self.mask = mask
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads, block_size, mask) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.causal_mask = CausalMask() if mask in ("additive", "sdpa") else None

    def forward(self, idx, targets):
        t = idx.shape[1]
        # made first, before any block: the earliest non-finite value of the step
        float_mask = self.causal_mask(idx) if self.causal_mask is not None else None
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, float_mask)
        logits = self.head(self.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def nanogpt(mask: str = "fill"):
    """The CLI's factory (``--model tests.capture_models:nanogpt``): a 3-block nanoGPT."""
    torch.manual_seed(0)
    return NanoGPT(mask=mask)


def hf_gpt2(attn_implementation: str = "sdpa"):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=2, attn_pdrop=0.0,
                                     embd_pdrop=0.0, resid_pdrop=0.0, attn_implementation=attn_implementation)
    return transformers.GPT2LMHeadModel(config)


def hf_llama(attn_implementation: str = "sdpa"):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(config)
