"""Nemotron-H checkpoints in and out of fp4train, and NVFP4 checkpoints that serving engines load.

- :mod:`~.nemotron_h`: the config and tensor-name mapping to and from transformers' ``NemotronH``;
- :mod:`~.hf_writer`: the ``hf`` export (a directory ``AutoModelForCausalLM`` loads);
- :mod:`~.load_run`: a run, checkpoint or Nemotron-H directory as (RunConfig, model, tokenizer);
- :mod:`~.importer`: a Nemotron-H directory as (RunConfig, model, tokenizer);
- :mod:`~.nvfp4_weights`: the NVFP4 weight values the training forward uses, per linear layer, and
  the one writer of an NVFP4 export's tensors (:class:`~.nvfp4_weights.NVFP4Layout`);
- :mod:`~.calibration`: input scales from a few batches of the run's data;
- :mod:`~.modelopt_writer` / :mod:`~.compressed_tensors_writer`: the two NVFP4 layouts (key names,
  global-scale direction, quantization_config);
- :mod:`~.export`: ``fp4train export``, which picks the writer or an NVFP4 layout.
"""
