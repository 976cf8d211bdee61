/* fuzz_rerank_request: libFuzzer target for the /rerank request parser (api.c). Parses the
 * input as a request body; when it parses, writes a response for it from a made-up result (each
 * document once, in reverse order), so the writer sees every string the parser let through. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const fitm_api_limits lim = {.max_documents = 64, .max_tokens_per_doc = 512,
                                        .model_name = "m", .default_temperature = 5e-5};
    fitm_rerank_request req;
    fitm_err err;
    if (fitm_api_parse_rerank((const char *)data, size, &lim, &req, &err) == FITM_OK) {
        fitm_rerank_doc_result *rs = calloc((size_t)req.n_docs, sizeof *rs);
        if (rs) {
            for (int32_t i = 0; i < req.n_docs; i++)
                rs[i] = (fitm_rerank_doc_result){.index = req.n_docs - 1 - i, .position = i,
                                                 .relevance_score = 1.0 / (i + 1)};
            fitm_rerank_result res = {.results = rs, .n_results = req.n_docs};
            free(fitm_api_write_rerank(&req, &res, "id", "m"));
            free(rs);
        }
    }
    fitm_rerank_request_free(&req);
    return 0;
}
