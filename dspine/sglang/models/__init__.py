"""Model classes SGLang's ``ModelRegistry.register("dspine.sglang.models")`` picks up (modules with ``EntryClass``)."""
