"""The run config's sections, one module each (hydra keys ``model``, ``lora``, ``rollout``,
``trainer``, ``logging``, ``controller``, ``tinker``); each dataclass checks its own values in
``validate()``. :mod:`miles_multilora.config.run` composes them and checks what crosses sections."""
