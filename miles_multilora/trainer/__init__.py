"""One trainer rank's primitives (:mod:`.rank`) and what they are built from: model build, forward/backward
over mixed-slot rows, data parallelism, slot shards, micro-batches, tokenizers."""
