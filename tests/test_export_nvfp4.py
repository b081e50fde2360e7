"""fp4train export --format nvfp4-modelopt | nvfp4-compressed-tensors: compressed-tensors reads both
layouts with its own unpacking and dequantization and gets exactly the weight values the training
forward uses; nibble order, scale shapes and the global scale's direction against hand-made known
answers; the layers the recipe keeps in BF16, the embeddings and the LM head are excluded."""

import json
import types

import pytest
import torch
from safetensors.torch import load_file

from inkling_fp4.config import RunConfig, from_dict
from inkling_fp4.errors import UserError
from inkling_fp4.interop.compressed_tensors_writer import compressed_tensors
from inkling_fp4.interop.load_run import load_run
from inkling_fp4.interop.modelopt_writer import modelopt_tensors
from inkling_fp4.interop.nvfp4_weights import nvfp4_recipe, quantize_weight
from inkling_fp4.numerics import nvfp4
from inkling_fp4.precision import gemm
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.linear_gemms import quantized_forward
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.precision.quant_linear import QuantLinear
from test_export_hf import run  # noqa: F401  (the module's pretrain run fixture)
from test_run_dir import cli, one_line

pytestmark = pytest.mark.slow

# The run fixture's pattern M*-M*- with the tiny recipe's first and last layer in BF16.
QUANTIZED = [
    "backbone.layers.1.mixer.q_proj",
    "backbone.layers.1.mixer.k_proj",
    "backbone.layers.1.mixer.v_proj",
    "backbone.layers.1.mixer.o_proj",
    "backbone.layers.2.mixer.up_proj",
    "backbone.layers.2.mixer.down_proj",
    "backbone.layers.3.mixer.in_proj",
    "backbone.layers.3.mixer.out_proj",
    "backbone.layers.4.mixer.q_proj",
    "backbone.layers.4.mixer.o_proj",
]
KEPT = [
    "backbone.layers.0.mixer.in_proj",
    "backbone.layers.0.mixer.out_proj",
    "backbone.layers.5.mixer.up_proj",
    "backbone.layers.5.mixer.down_proj",
    "backbone.embeddings",
    "lm_head",
]


@pytest.fixture(scope="module")
def ct():
    """compressed-tensors' own readers (a dev dependency)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    return types.SimpleNamespace(
        unpack=unpack_fp4_from_uint8,
        dequantize=dequantize,
        Config=QuantizationConfig,
        ModelOpt=ModelOptNvfp4Converter,
    )


def ct_weight(ct, packed, scale, global_scale, weights_args) -> torch.Tensor:
    """compressed-tensors' own unpacking and dequantization, in FP32."""
    m, n = packed.shape
    x_q = ct.unpack(packed, m, n * 2, dtype=torch.float32)
    return ct.dequantize(
        x_q, scale.to(torch.float32), args=weights_args, dtype=torch.float32, global_scale=global_scale
    )


def fp4train_weights(run_dir):
    """{transformers module: the NVFP4 weight values of the training fprop}, from the run itself."""
    cfg, model, _ = load_run(run_dir)
    _, recipe = nvfp4_recipe(cfg)
    out = {}
    for i, block in enumerate(model.layers):
        p = f"backbone.layers.{i}.mixer."
        for linear in (m for m in block.mixer.modules() if isinstance(m, QuantLinear)):
            w = quantize_weight(linear, recipe).dequantize()
            if linear.name == "attn.qkv_proj":
                E = cfg.model.attn_head_dim
                q, k, v = w.split([cfg.model.n_heads * E, cfg.model.n_kv_heads * E, cfg.model.n_kv_heads * E])
                out.update({p + "q_proj": q, p + "k_proj": k, p + "v_proj": v})
            else:
                out[p + linear.name.split(".")[1]] = w
    return out


@pytest.fixture(scope="module")
def exports(run, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("exports")
    for fmt in ("nvfp4-modelopt", "nvfp4-compressed-tensors"):
        code, out, err = cli(
            [
                "export",
                "--from",
                str(run),
                "--format",
                fmt,
                "--out",
                str(root / fmt),
                "export.calibration_batches=2",
                "export.calibration_batch_size=2",
            ]
        )
        assert code == 0, err
        assert "calibrating input scales: 2 batches" in out and "linear modules NVFP4" in out
    return root / "nvfp4-modelopt", root / "nvfp4-compressed-tensors"


def test_compressed_tensors_reads_the_export_with_the_training_weights(exports, run, ct):  # noqa: F811
    _, path = exports
    config = json.loads((path / "config.json").read_text())
    qc = ct.Config.model_validate(config["quantization_config"])
    assert qc.format == "nvfp4-pack-quantized" and qc.quant_method == "compressed-tensors"
    scheme = qc.config_groups["group_0"]
    assert scheme.weights.strategy == "tensor_group" and scheme.weights.group_size == 16
    assert sorted(qc.ignore) == sorted(KEPT)
    tensors = load_file(str(path / "model.safetensors"))
    want = fp4train_weights(run)
    assert sorted(m for m in want if f"{m}.weight_packed" in tensors) == sorted(
        QUANTIZED + ["backbone.layers.4.mixer.k_proj", "backbone.layers.4.mixer.v_proj"]
    )
    for module, w in want.items():
        if f"{module}.weight_packed" not in tensors:
            assert tensors[f"{module}.weight"].dtype == torch.bfloat16  # a BF16 layer, unquantized
            continue
        packed, scale = tensors[f"{module}.weight_packed"], tensors[f"{module}.weight_scale"]
        out_f, in_f = w.shape
        assert packed.dtype == torch.uint8 and packed.shape == (out_f, in_f // 2)
        assert scale.dtype == torch.float8_e4m3fn and scale.shape == (out_f, in_f // 16)
        got = ct_weight(ct, packed, scale, tensors[f"{module}.weight_global_scale"], scheme.weights)
        # one rounding of code·scale by S_enc (theirs a division, ours a product by 1/S_enc)
        torch.testing.assert_close(got, w, rtol=2**-23, atol=0)
        assert tensors[f"{module}.input_global_scale"].item() > 0
    for prefix in ("backbone.layers.1.mixer.", "backbone.layers.4.mixer."):  # q, k, v: one global scale
        scales = {tensors[f"{prefix}{p}_proj.weight_global_scale"].item() for p in "qkv"}
        assert len(scales) == 1


def test_compressed_tensors_converts_the_modelopt_export(exports, run, ct):  # noqa: F811
    path, ct_path = exports
    quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert (
        quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16 and quant["kv_cache_quant_algo"] is None
    )
    assert sorted(quant["exclude_modules"]) == sorted(KEPT)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    tensors = load_file(str(path / "model.safetensors"))
    for module in QUANTIZED:
        assert (
            tensors[f"{module}.weight"].dtype == torch.uint8
            and tensors[f"{module}.weight_scale_2"].dim() == 0
        )
    converter = ct.ModelOpt(ignore=quant["exclude_modules"], targets=["re:.*_proj$"])
    converted = converter.validate(dict(tensors))
    scheme = converter._build_quant_config().config_groups["config_group_0"]
    want = fp4train_weights(run)
    ct_tensors = load_file(str(ct_path / "model.safetensors"))
    for module in QUANTIZED:
        got = ct_weight(
            ct,
            converted[f"{module}.weight_packed"],
            converted[f"{module}.weight_scale"],
            converted[f"{module}.weight_global_scale"],
            scheme.weights,
        )
        torch.testing.assert_close(got, want[module], rtol=2**-22, atol=0)
        # the two layouts carry the same codes and block scales, and global scales in opposite directions
        assert torch.equal(tensors[f"{module}.weight"], ct_tensors[f"{module}.weight_packed"])
        s2, g = (
            tensors[f"{module}.weight_scale_2"].double(),
            ct_tensors[f"{module}.weight_global_scale"].double(),
        )
        assert abs((s2 * g).item() - 1) < 1e-6
        i2, ig = (
            tensors[f"{module}.input_scale"].double(),
            ct_tensors[f"{module}.input_global_scale"].double(),
        )
        assert abs((i2 * ig).item() - 1) < 1e-6


def test_the_weight_values_are_those_of_the_training_forward(run):  # noqa: F811
    """y = x·Wᵀ through QuantLinear's fprop equals Q(x) times the exported weight values."""
    cfg, model, _ = load_run(run)
    _, recipe = nvfp4_recipe(cfg)
    linear = model.layers[2].mixer.up_proj
    w = quantize_weight(linear, recipe).dequantize().double()
    x = torch.randn(8, linear.in_features)
    y = quantized_forward(x, linear.weight.detach(), recipe, out_dtype=torch.float32).double()
    xq = nvfp4.quantize(x).dequantize().double()
    torch.testing.assert_close(y, xq @ w.T, rtol=1e-5, atol=1e-6)


def hand_made_weight():
    """[16, 32]: tile (0, 0) has amax 6 at W[0, 0] and -0.5 at W[0, 1]; tile (0, 1) has amax 3 at W[3, 16]."""
    W = torch.zeros(16, 32)
    W[0, 0], W[0, 1], W[3, 16] = 6.0, -0.5, 3.0
    return W


def test_known_answers_nibbles_scales_and_global_scale_direction():
    recipe = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), n_layers=1).recipe
    linear = QuantLinear(32, 16, layer_idx=0, name="mlp.up_proj")
    with torch.no_grad():
        linear.weight.copy_(hand_made_weight())
    w = quantize_weight(linear, recipe)
    # S_enc = 6·448 / amax = 448; tile scales e4m3(amax_tile · S_enc / 6) = 448 and 224
    assert w.encode_scale.item() == 448.0 and w.decode_scale.item() == torch.tensor(1 / 448).item()  # FP32
    assert w.codes.shape == (16, 16) and w.scales.shape == (16, 2)
    assert (w.scales[:, 0].float() == 448).all() and (w.scales[:, 1].float() == 224).all()  # repeated per row
    # 6 -> code 0b0111 (low nibble, even element), -0.5 -> sign | 0b001 = 0x9 (high nibble)
    assert w.codes[0, 0].item() == 0x97
    # 3 / (224 / 448) = 6 -> code 7 in the low nibble of byte 8 (elements 16, 17)
    assert w.codes[3, 8].item() == 0x07
    assert int(w.codes.count_nonzero()) == 2
    base = {"m.weight": hand_made_weight(), "n.weight": torch.ones(2, 2)}
    amax = {"m": torch.tensor(2688.0)}
    mo = modelopt_tensors(base, {"m": w}, amax)
    assert mo["m.weight_scale_2"].item() == pytest.approx(1 / 448) and mo["m.input_scale"].item() == 1.0
    assert mo["n.weight"].dtype == torch.bfloat16
    cts = compressed_tensors(base, {"m": w}, {"m": torch.tensor(1344.0)})
    assert cts["m.weight_global_scale"].tolist() == [448.0] and cts["m.input_global_scale"].tolist() == [2.0]
    assert torch.equal(cts["m.weight_packed"], mo["m.weight"]) and torch.equal(
        cts["m.weight_scale"].view(torch.uint8), w.scales.view(torch.uint8)
    )


def test_a_run_without_nvfp4_weights_is_refused(run, tmp_path):  # noqa: F811
    cfg = from_dict(RunConfig, {"precision": {"recipe": "bf16"}})
    with pytest.raises(UserError, match="--format hf"):
        nvfp4_recipe(cfg)
    code, _, err = cli(
        [
            "export",
            "--from",
            str(run),
            "--format",
            "nvfp4-modelopt",
            "--out",
            str(tmp_path / "o"),
            "train.steps=3",
        ]
    )
    assert code == 2 and "export.<field>" in one_line(err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_training_quantizer_gives_the_exported_weights():
    """On CUDA the fprop quantizes W with the fused kernel: its codes, scales and the values it
    multiplies are the export's (which quantizes on the CPU)."""
    recipe = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), n_layers=1).recipe
    torch.manual_seed(0)
    linear = QuantLinear(64, 100, layer_idx=0, name="mlp.up_proj")  # 100 rows: a partial last tile
    w = quantize_weight(linear, recipe)
    op = gemm.quantize(linear.weight.detach().cuda(), recipe.fprop.b, codes=True, values=True)
    assert torch.equal(op.q.codes[:100].cpu(), w.codes)
    assert torch.equal(op.q.scales[:100].cpu().view(torch.uint8), w.scales.view(torch.uint8))
    values = op.values[:100].float() * (op.decode_scale if op.decode_scale is not None else op.q.decode_scale)
    assert torch.equal(values.cpu(), w.dequantize())
