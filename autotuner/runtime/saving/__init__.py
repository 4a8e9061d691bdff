"""What the engine saves: DCP checkpoints, save_16bit_model, and whole weights from FSDP2's shards
where a DeepSpeed script reads or saves them."""
