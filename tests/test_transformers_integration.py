"""flash_cutlass inside Hugging Face transformers models (flash_cutlass.integrations.transformers).

Tiny random-initialised Llama-, Mistral-, Gemma-2- and gpt-oss-style models (gpt-oss: learned
attention sinks, sliding and full layers), built from configs (nothing is downloaded), run with
attn_implementation set to flash_cutlass and to transformers' own ("sdpa"; "eager" for Gemma 2 and
gpt-oss): the logits at every real token and the weight gradients (the sinks' too) pass
FlashAttention-2's rule against the same model in float32 (transformers' attention there: the
oracle; in bfloat16: the baseline), with left- and right-padded batches; sequences packed into one
row give each sequence's own logits; generate() returns the same greedy tokens. CPU (the reference) always; CUDA (the kernels) where a GPU is visible. Skipped without
transformers (an optional dependency: pip install transformers).
"""

import copy

import pytest
import torch

from helpers import fa2_check, requires_cuda

transformers = pytest.importorskip("transformers")
fc_transformers = pytest.importorskip("flash_cutlass.integrations.transformers")

NAME = fc_transformers.register()
VOCAB = 97


def config_of(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":  # a sliding window shorter than the sequences
        return transformers.MistralConfig(sliding_window=8, **common)
    if family == "gpt_oss":  # attention sinks; sliding and full layers
        # Every token through every expert: a top-k choice that rounding can flip would change the
        # logits by far more than attention's rounding does.
        return transformers.GptOssConfig(sliding_window=8, num_local_experts=2, num_experts_per_tok=2,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    # Gemma 2: soft-capped scores, local (window) and global layers alternating.
    return transformers.Gemma2Config(sliding_window=8, attn_logit_softcapping=20.0, final_logit_softcapping=None,
                                     query_pre_attn_scalar=16, **common)


def models(family: str, device: str):
    """The same weights three times: float32 on transformers' own attention (oracle), bfloat16 on
    it (baseline), bfloat16 on flash_cutlass. Their own attention is "sdpa", or "eager" for Gemma 2
    (its soft cap has no sdpa form) and gpt-oss (nor its sinks)."""
    torch.manual_seed(0)
    config = config_of(family)
    reference = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"
    # Each model its own config: a model records its attention implementation in its config.
    oracle = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    oracle = oracle.to(device).float()
    with torch.no_grad():
        for layer in oracle.model.layers:
            if hasattr(layer.self_attn, "sinks"):  # sinks of a few units, where they matter (init: ~0.02)
                layer.self_attn.sinks.copy_(2 * torch.randn(layer.self_attn.sinks.shape) + 1)
    state = oracle.state_dict()
    built = [oracle]
    for implementation in (reference, NAME):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
        model.load_state_dict(state)
        built.append(model.to(device=device, dtype=torch.bfloat16))
    return built


def batch_of(device: str, padding: str, batch=3, seqlen=24):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (batch, seqlen), generator=generator)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    for row, pad in enumerate((0, 5, 11)[:batch]):
        if padding == "left":
            mask[row, :pad] = 0
        elif padding == "right" and pad:
            mask[row, -pad:] = 0
    input_ids = input_ids.masked_fill(mask == 0, 0)
    return input_ids.to(device), mask.to(device)


def logits_and_grads(model, input_ids, mask, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, attention_mask=mask, **kwargs)
    logits = out.logits
    valid = mask.bool()
    # Next-token loss between real tokens only: a padded position's output is not defined alike by
    # every implementation (flash_cutlass returns zeros there).
    labels = input_ids[:, 1:].masked_fill(~(valid[:, 1:] & valid[:, :-1]), -100)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    layer = model.model.layers[0]
    grads = [layer.self_attn.q_proj.weight.grad, layer.self_attn.v_proj.weight.grad, model.model.embed_tokens.weight.grad]
    grads += [other.self_attn.sinks.grad for other in model.model.layers if hasattr(other.self_attn, "sinks")]
    return logits[valid].detach(), [g.detach() for g in grads]


def devices():
    return ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_logits_and_gradients_match_sdpa(family, padding, device):
    oracle, baseline, ours = models(family, device)
    input_ids, mask = batch_of(device, padding)
    expected_logits, expected_grads = logits_and_grads(oracle, input_ids, mask)
    base_logits, base_grads = logits_and_grads(baseline, input_ids, mask)
    logits, grads = logits_and_grads(ours, input_ids, mask)
    fa2_check(logits, expected_logits, base_logits, f"{family} {padding} logits")
    names = ("q_proj", "v_proj", "embed_tokens", "sinks of the sliding layer", "sinks of the full layer")
    assert len(grads) == (5 if family == "gpt_oss" else 3)
    for name, grad, expected, base in zip(names, grads, expected_grads, base_grads):
        # A sink's gradient sums rowsum(dout * out) over every row, from out rounded to bf16, whose
        # error does not average out there as in autograd's softmax gradient (tests/helpers.py,
        # check_sinks_gradient): it may also be off by 2^-7 of its largest entry.
        eps = 2**-7 * float(expected.abs().max()) if name.startswith("sinks") else 1e-5
        fa2_check(grad, expected, base, f"{family} {padding} d{name}", eps=eps)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("told_by", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_sequences_packed_into_one_row(family, told_by, device):
    """Three sequences in one row, told apart by position ids that restart, or by the cumulative
    lengths transformers' packing collator passes: the same logits as each sequence alone."""
    _, _, ours = models(family, device)
    lengths = (9, 20, 6)
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(1, VOCAB, (n,), generator=generator).to(device) for n in lengths]
    packed_ids = torch.cat(sequences).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    extra = {}
    if told_by == "cu_seq_lens":
        cu_seq_lens = torch.tensor([0, 9, 29, 35], dtype=torch.int32, device=device)
        extra = dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=20, max_length_k=20)
    with torch.no_grad():
        packed = ours(input_ids=packed_ids, position_ids=position_ids, **extra).logits[0]
        alone = torch.cat([ours(input_ids=s.unsqueeze(0)).logits[0] for s in sequences])
    torch.testing.assert_close(packed.float(), alone.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss"])
def test_generate_gives_the_same_greedy_tokens(family, device):
    _, baseline, ours = models(family, device)
    input_ids, mask = batch_of(device, "left")
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = baseline.generate(input_ids, **settings)
        tokens = ours.generate(input_ids, **settings)
    assert torch.equal(tokens, expected)


def test_names_with_flash_are_refused():
    with pytest.raises(ValueError, match="contains 'flash'"):
        fc_transformers.register("flash_cutlass")


def test_a_padding_mask_is_unpadded_once_and_never_stale():
    """The layers of one forward share their mask's unpadding; a mask changed in place, or a new
    mask with the same values, gives the result of a fresh computation."""
    generator = torch.Generator().manual_seed(3)
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(3, 4, 12, 16, generator=generator).to(torch.bfloat16) for _ in range(3))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0
    first, _ = fc_transformers.attention_forward(module, q, k, v, mask)
    cached = fc_transformers._unpadding_of(mask, 12)
    assert fc_transformers._unpadding_of(mask, 12) is cached  # the next layer's lookup
    again, _ = fc_transformers.attention_forward(module, q, k, v, mask)
    assert torch.equal(again, first)
    mask[2, :7] = 0  # changed in place: its version counter moved
    assert fc_transformers._unpadding_of(mask, 12) is not cached
    changed, _ = fc_transformers.attention_forward(module, q, k, v, mask)
    fresh, _ = fc_transformers.attention_forward(module, q, k, v, mask.clone())
    assert torch.equal(changed, fresh) and not torch.equal(changed, first)
