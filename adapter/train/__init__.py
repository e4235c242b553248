"""Training-loop support: data pipeline, checkpoint bookkeeping around DeepSpeed, throughput and MFU metrics."""
