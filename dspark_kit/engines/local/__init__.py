"""The local engine: the kit's own OpenAI-compatible server (FastAPI + transformers) for CPU, CUDA
and NPU, for the roles vLLM cannot take here (spec decoding on CPU) and for tests.

- plan.py: the server's command for a recipe and role (`plan_local`);
- server.py: the process (`python -m dspark_kit.engines.local.server`); api.py its request checks;
  engine.py the generation loop; stream.py streamed text; tools.py tool-call parsing as vLLM's.

Part of engines/ (layer 4): may import the layers below (core, data/, specdec/, compat/,
distributed/) and the rest of engines/; never the resolver package (its plan takes the stage's
plain values), stages/ or cli/.
"""
