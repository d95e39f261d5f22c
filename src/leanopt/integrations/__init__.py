"""Where users train: Hugging Face ``Trainer``, Accelerate, ``torch.distributed`` (DDP, FSDP2).

Each integration is its own module and imports its framework only when imported itself:
``leanopt.integrations.transformers`` needs ``transformers``, ``leanopt.integrations.distributed``
needs only torch. Nothing here is imported by ``import leanopt``.
"""
