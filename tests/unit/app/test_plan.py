"""`python -m app.plan`: sizes from a model's shapes alone, checked against the parameters transformers and peft
actually build, and the plan's arithmetic (times, notice windows, cost)."""

import json

import pytest

from app.plan import KNOWN, NOTICE_WINDOWS_S, lora_params, main, make_plan, model_params, shape_of


@pytest.mark.parametrize("bias, tied", [(True, True), (False, False)])
def test_the_sizes_are_the_parameters_transformers_and_peft_build(tmp_path, bias, tied):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    if not bias:  # a Llama-like block: no biases on q, k, v
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias = None
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["attention_bias"] = bias
    (tmp_path / "config.json").write_text(json.dumps(saved))
    shape = shape_of(str(tmp_path))
    assert model_params(shape) == sum(p.numel() for p in model.parameters())
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert lora_params(shape, 4) == sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert lora_params(shape, 4, ["q_proj", "v_proj"]) == 3 * 4 * ((64 + 64) + (64 + 32))


def test_known_models_need_no_download_and_the_seed_adapter_is_a_few_megabytes():
    shape = shape_of("Qwen/Qwen2.5-Math-1.5B")
    assert shape is KNOWN["qwen/qwen2.5-math-1.5b"] and shape_of("qwen2.5-math-1.5b") is shape
    assert round(model_params(shape) / 1e9, 2) == 1.54  # the published 1.54B
    assert round(model_params(shape_of("Qwen/Qwen2.5-7B")) / 1e9, 2) == 7.62
    plan = make_plan("Qwen/Qwen2.5-Math-1.5B", 1, bandwidth_mb_s=100.0)
    # bench/adapter_sync.py measured 4.45 MiB for this adapter's safetensors (a header more than the weights).
    assert plan.adapter_bytes == 1_154_048 * 4
    assert plan.full_weights_bytes == model_params(shape) * 2  # bf16
    with pytest.raises(SystemExit, match="not a known model"):
        shape_of("nobody/unknown-model")


def test_the_plan_says_what_fits_a_notice_and_what_the_cluster_costs():
    slow = make_plan("Qwen/Qwen2.5-7B", 64, bandwidth_mb_s=20.0, gpus=9, spot=2.0, on_demand=5.0, head=1.0)
    # 7B rank 64: ~162M adapter parameters, ~1.9 GB checkpoint: 97 s at 20 MB/s, inside AWS's 120 s, not GCP's 30 s.
    assert slow.checkpoint_upload_s == pytest.approx(slow.checkpoint_bytes / 20e6)
    assert slow.checkpoint_fits == {"aws": True, "gcp": False}
    assert slow.checkpoint_upload_s < NOTICE_WINDOWS_S["aws"]
    assert slow.full_checkpoint_fits == {"aws": False, "gcp": False}
    assert (slow.cost_per_hour_spot, slow.cost_per_hour_on_demand) == (19.0, 46.0)


def test_the_command_reads_a_run_config_and_prints_lines_or_json(capsys):
    main(["--config", "configs/qwen2.5-math-1.5b.yaml", "--bandwidth", "200", "--spot", "2.5", "--on-demand", "6"])
    out = capsys.readouterr().out
    assert "LoRA rank 1" in out and "8 replicas, 10 GPUs" in out and "learner checkpoint" in out
    assert "cost per hour on spot:" in out and "spot saves 58%" in out
    main(["--model", "tiny", "--rank", "8", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["lora_rank"] == 8 and plan["checkpoint_bytes"] == 3 * plan["adapter_bytes"]
