"""Worker of test_placement.py: host-memory growth while P2RStrategy builds and places a model of several hundred MB.

Measures this process's resident-memory growth from the start of Lightning's ``setup`` (before ``configure_model``)
to the first training batch with the benchmarks' ``SetupMemoryProbe``, and writes it with the model's fp32 bytes.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch

from lightning_p2r import M6Config, M6LanguageModel, OptimizerConfig, P2RStrategy
from lightning_p2r.measure.memory import SetupMemoryProbe

MODEL = {"vocab_size": 256, "max_seq_len": 16, "num_layers": 12, "dim": 1024, "num_heads": 16, "moe_layers": []}
# The same size as a Hugging Face Llama built by CausalLMModule in configure_model (its own initialization).
HF_MODEL = {"model_type": "llama", "vocab_size": 256, "hidden_size": 1024, "intermediate_size": 2816,
            "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 16,
            "max_position_embeddings": 64, "tie_word_embeddings": True}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--strategy", type=str, required=True, help="JSON keyword arguments of P2RStrategy")
    parser.add_argument("--model", choices=("m6", "hf"), default="m6")
    args = parser.parse_args()
    L.seed_everything(0)
    if args.model == "hf":
        from lightning_p2r import CausalLMModule

        module = CausalLMModule(hf_config=HF_MODEL, optimizer={"warmup_steps": 1})
    else:
        module = M6LanguageModel(M6Config(**MODEL), OptimizerConfig(warmup_steps=1))
    probe = SetupMemoryProbe()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=P2RStrategy(**json.loads(args.strategy)),
                        max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
    data = torch.randint(0, MODEL["vocab_size"], (4 * args.devices, MODEL["max_seq_len"] + 1))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    param_bytes = sum(p.numel() * 4 for p in module.parameters())
    report = {"growth": probe.result.setup_growth, "param_bytes": param_bytes, "steps": trainer.global_step}
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
