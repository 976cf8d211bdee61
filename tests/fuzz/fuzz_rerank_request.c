/* fuzz_rerank_request: libFuzzer target for every request parser of api.c: /rerank, /answer,
 * the OpenAI routes (chat and completions), vLLM's /v1/score, /tokenize and /detokenize.
 * Parses the input as a request body of each; when it parses, writes a response for it from a
 * made-up result (each document once, in reverse order; for the answers the request's own
 * bytes as the answer, valid UTF-8 or not), so the writers see every string the parsers let
 * through. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/api.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const fitm_api_limits lim = {.max_documents = 64, .max_tokens_per_doc = 512,
                                        .model_name = "m",
                                        .max_answer_tokens = 64};
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

    fitm_answer_request areq;
    if (fitm_api_parse_answer((const char *)data, size, &lim, &areq, &err) == FITM_OK) {
        fitm_answer_doc *ds = calloc((size_t)areq.base.n_docs, sizeof *ds);
        char *text = malloc(size + 1);
        if (ds && text) {
            for (int32_t i = 0; i < areq.base.n_docs; i++)
                ds[i] = (fitm_answer_doc){.index = i, .position = areq.base.n_docs - 1 - i,
                                          .weight = 1.0 / areq.base.n_docs};
            memcpy(text, data, size);
            text[size] = '\0';
            fitm_answer_result res = {.answer = text, .answer_len = size, .docs = ds,
                                      .n_docs = areq.base.n_docs};
            free(fitm_api_write_answer(&areq, &res, "id", "m", 0, 0, true));
            free(fitm_api_write_answer_delta(text, size));
        }
        free(ds);
        free(text);
    }
    fitm_answer_request_free(&areq);

    for (int chat = 0; chat < 2; chat++) {
        bool usage = false;
        if (fitm_api_parse_openai((const char *)data, size, &lim, chat, &areq, &usage, &err) ==
            FITM_OK) {
            fitm_answer_doc *ds = calloc((size_t)areq.base.n_docs + 1, sizeof *ds);
            char *text = malloc(size + 1);
            if (ds && text) {
                for (int32_t i = 0; i < areq.base.n_docs; i++)
                    ds[i] = (fitm_answer_doc){.index = i, .position = i, .weight = 1.0};
                memcpy(text, data, size);
                text[size] = '\0';
                fitm_answer_result res = {.answer = text, .answer_len = size, .docs = ds,
                                          .n_docs = areq.base.n_docs};
                const fitm_api_openai_head h = {"chatcmpl-1", "m", 1, chat != 0};
                free(fitm_api_write_openai(&h, &res));
                free(fitm_api_write_openai_chunk(&h, (const char *)data, size, true, NULL,
                                                 false));
                free(fitm_api_write_openai_chunk(&h, NULL, 0, false, &res, usage));
            }
            free(ds);
            free(text);
        }
        fitm_answer_request_free(&areq);
    }

    if (fitm_api_parse_score((const char *)data, size, &lim, &req, &err) == FITM_OK) {
        fitm_rerank_doc_result *rs = calloc((size_t)req.n_docs, sizeof *rs);
        if (rs) {
            for (int32_t i = 0; i < req.n_docs; i++)
                rs[i] = (fitm_rerank_doc_result){.index = i, .relevance_score = 0.5};
            fitm_rerank_result res = {.results = rs, .n_results = req.n_docs};
            free(fitm_api_write_score(&res, "id", "m", 1));
            free(rs);
        }
    }
    fitm_rerank_request_free(&req);

    for (int de = 0; de < 2; de++) {
        fitm_api_tokens t;
        if (fitm_api_parse_tokens((const char *)data, size, &lim, de, &t, &err) == FITM_OK) {
            if (!de && !t.ids && t.text_len) { /* tokenize: some ids as the tokenizer's */
                t.ids = calloc(t.text_len, sizeof *t.ids);
                t.n_ids = t.ids ? (int64_t)t.text_len : 0;
            }
            if (de && !t.text) { /* detokenize: the request's bytes as the text */
                t.text = malloc(size + 1);
                if (t.text) {
                    memcpy(t.text, data, size);
                    t.text[size] = '\0';
                    t.text_len = size;
                }
            }
            free(fitm_api_write_tokens(&t, 2048));
        }
        fitm_api_tokens_free(&t);
    }
    return 0;
}
