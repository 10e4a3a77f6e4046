# Stand-in for vllm/model_executor/layers/quantization/inc.py (molecule vllm_build test context).
class INCConfig:
    """Quantization config of INC/AutoRound checkpoints."""

    def get_quant_method(self, layer, prefix):
        if self.is_quantized(prefix):
            return "gptq_marlin"
        return "unquantized"

    def is_quantized(self, prefix):
        return "experts" in prefix
