"""The torch engine: `services.worker.engine.Engine` on Ballast's own plain-torch Llama
decoder (or transformers for other models), beside `services.worker.vllm`.

Modules:
  engine         TorchEngine itself: validation, admission, streaming, session KV
  step_scheduler batches decode steps of running sequences and prefills of waiting ones
  model_runner   the model and its KV slot pool; one forward pass per step
  llama          the plain-torch Llama-family decoder (transformers checks its logits)
  tokenizer      the model folder's tokenizer, for the engine's own use
"""
