"""The run config's fields as ``diffattn train --help`` lists them, without importing torch: the train, data and
classify sections read from their dataclasses (:mod:`diffattn.configs.sections`, light), so each default is written
once. The model's and the retrofit's sections are written out here, because
:class:`~diffattn.model.config.ModelConfig` and the retrofit's target types import torch; a test
(tests/cli/test_cli_help.py) fails when they differ from the dataclasses', and
``python -c "from diffattn.configs.run_config import field_items; print(field_items()['model'])"`` prints it."""

from diffattn.configs.sections import ClassifyConfig, DataConfig, TrainConfig, section_items

_MODEL = [
    'vocab_size (from the data)',
    'd_model=256',
    'n_layers=4',
    'n_heads=4',
    'n_kv_heads',
    "attention='diff'",
    'max_seq_len (>= train.seq_len)',
    "rope='interleaved'",
    'rope_theta=10000.0',
    'ffn_hidden',
    'tie_embeddings=True',
    'norm_eps=1e-05',
    'dropout=0.0',
    'bias=False',
    'head_dim',
    'init_std=0.02',
    'causal=True',
    'shared_qk=False',
    'attn_options',
    'qkv_bias',
    'out_bias',
    'qk_norm=False',
    'sliding_window',
    'window_layers',
    'rope_local_theta',
    'rope_factor=1.0',
    'post_attn_norm=False',
    'post_ffn_norm=False',
    'norm_unit_offset=False',
    "mlp_activation='silu'",
    'scale_embeddings=False',
    'query_pre_attn_scalar',
    'family',
    'layer_attention',
    'diff_heads',
]
# The [retrofit] section (configs/retrofit.py imports the attention registry, so torch): written out as well
_RETROFIT = ['to', 'steps=0', "shape='linear'", 'lambda_init', 'layers', 'top_k_layers=0', 'heads',
             'top_k_heads=0', 'score_batches=4', "train='all'"]

FIELDS: dict[str, list[str]] = {"model": _MODEL, **{name: section_items(name, cls) for name, cls in
                                                    (("train", TrainConfig), ("data", DataConfig),
                                                     ("classify", ClassifyConfig))}, "retrofit": _RETROFIT}
