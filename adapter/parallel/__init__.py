"""The four sizes turned into processes: pure rank arithmetic (`layout.py`), Megatron-Core's groups checked against
it (`mcore_groups.py`), the DeepSpeed ZeRO JSON (`deepspeed_config.py`) and the MPU object DeepSpeed asks for groups
(`deepspeed_mpu.py`)."""
