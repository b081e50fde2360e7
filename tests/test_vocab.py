"""grow_vocab: new embedding and head rows at the mean, old rows untouched, the model still trains."""

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from data_corpus import fresh_rng, random_texts
from fresh_seed import fresh_generator
from inkling_fp4.data.tokenizer import SPECIAL_TOKENS, Tokenizer, check_vocab
from inkling_fp4.errors import DataError
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.model.vocab import grow_vocab

TINY = dict(pattern="M*-", d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, mamba_heads=4, mamba_head_dim=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grow_keeps_old_rows_and_adds_mean_rows(dtype):
    gen = fresh_generator()
    old = int(torch.randint(300, 600, (1,), generator=gen))
    added = int(torch.randint(1, 40, (1,), generator=gen))
    model = HybridLM(ModelConfig(vocab_size=old, **TINY)).to(dtype)
    with torch.no_grad():  # rows far from zero mean, so a zero or random row would show
        model.embed.weight.add_(torch.randn(1, 32, generator=gen).to(dtype))
    embed, head = model.embed.weight.detach().clone(), model.lm_head.weight.detach().clone()
    assert grow_vocab(model, old + added) == added
    for module, before in ((model.embed, embed), (model.lm_head, head)):
        w = module.weight
        assert w.shape == (old + added, 32) and w.dtype == dtype and w.requires_grad
        assert torch.equal(w[:old], before)  # bit-identical
        mean = before.float().mean(0).to(dtype)
        assert torch.equal(w[old:], mean.expand(added, -1))
    assert model.embed.num_embeddings == model.lm_head.out_features == model.cfg.vocab_size == old + added
    assert {id(p) for p in model.parameters()} >= {id(model.embed.weight), id(model.lm_head.weight)}
    assert grow_vocab(model, old + added) == 0 and grow_vocab(model, old) == 0  # it fits: nothing to do
    assert model.embed.weight.shape[0] == old + added


def test_grown_model_runs_forward_and_backward():
    gen = fresh_generator()
    model = HybridLM(ModelConfig(vocab_size=300, **TINY))
    grow_vocab(model, 310)
    ids = torch.randint(0, 310, (2, 24), generator=gen)
    ids[:, ::5] = torch.arange(300, 310).repeat(2)[: ids[:, ::5].numel()].view(2, -1)  # the new tokens
    logits = model(ids)
    assert logits.shape == (2, 24, 310) and torch.isfinite(logits).all()
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and torch.isfinite(p.grad).all(), name
    assert model.embed.weight.grad[300:].abs().sum() > 0 and model.lm_head.weight.grad[300:].abs().sum() > 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built after the growth, as documented
    optimizer.step()


def test_a_foreign_tokenizer_gets_rows_for_its_added_specials():
    # A tokenizer without the chat template's tokens: they are appended after its vocabulary.
    tok = Tokenizer.train_bpe(random_texts(fresh_rng(), 100), vocab_size=400, show_progress=False)
    vocab = {t: i for t, i in tok.hf.get_vocab().items() if t not in SPECIAL_TOKENS[1:]}
    foreign = Tokenizer(HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>")))
    assert foreign.added_specials == list(SPECIAL_TOKENS[1:])
    model = HybridLM(ModelConfig(vocab_size=len(vocab), **TINY))
    with pytest.raises(DataError, match="model.vocab_size"):
        check_vocab(foreign, model.cfg.vocab_size)
    assert grow_vocab(model, foreign.vocab_size) == len(SPECIAL_TOKENS) - 1
    check_vocab(foreign, model.cfg.vocab_size)
    assert (
        model(torch.tensor([[foreign.bos, foreign.role_ids["user"], foreign.end]])).shape[-1]
        == foreign.vocab_size
    )


def test_mean_init_rows_resets_spare_rows_and_grows_for_the_rest():
    """Tokens added inside a padded vocabulary get the mean of the other rows; ids past it grow."""
    from inkling_fp4.model.config import ModelConfig
    from inkling_fp4.model.hybrid import HybridLM
    from inkling_fp4.model.vocab import mean_init_rows

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    cfg = ModelConfig(pattern="M-", d_model=32, vocab_size=64, n_heads=2, n_kv_heads=1, ffn_dim=64,
                      mamba_heads=4, mamba_head_dim=16, n_groups=1, d_state=8)  # fmt: skip
    model = HybridLM(cfg)
    embed, head = model.embed.weight.detach().clone(), model.lm_head.weight.detach().clone()
    ids = [10, 63, 65]
    assert mean_init_rows(model, ids) == 3 and model.embed.num_embeddings == 66
    others = [i for i in range(64) if i not in (10, 63)]
    for new, old in ((model.embed.weight, embed), (model.lm_head.weight, head)):
        mean = old[others].float().mean(0).to(old.dtype)
        assert all(torch.equal(new[i], mean) for i in (10, 63, 65))
        assert torch.equal(new[others], old[others])  # every other row bit for bit
