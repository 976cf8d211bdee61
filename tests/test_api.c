/* Unit test for api.c: the error mapping, the /rerank parser's checks (each bad input names
 * its field), UTF-8 validation, and the response writer's shape and top_n cut. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "check.h"
#include "server/api.h"

static const fitm_api_limits LIM = {.max_documents = 4, .max_tokens_per_doc = 100,
                                    .model_name = "m", .strict_model = true,
                                    .max_answer_tokens = 50};

/* Parses body; checks the status and that the message contains want (when non-NULL). */
static void expect(const char *body, fitm_status want_st, const char *want)
{
    fitm_rerank_request req;
    fitm_err err = {{0}};
    fitm_status st = fitm_api_parse_rerank(body, strlen(body), &LIM, &req, &err);
    if (st != want_st || (want && !strstr(err.msg, want))) {
        fprintf(stderr, "body %s: got %s '%s', want %s '%s'\n", body, fitm_status_name(st),
                err.msg, fitm_status_name(want_st), want ? want : "");
        failures++;
    }
    fitm_rerank_request_free(&req);
}

static void test_classify(void)
{
    fitm_api_error_class c = fitm_api_classify(FITM_ERR_INVALID, FITM_API_COND_NONE);
    CHECK(c.http == 400 && !c.retry);
    CHECK(fitm_api_classify(FITM_ERR_FORMAT, FITM_API_COND_NONE).http == 400);
    CHECK(!strcmp(fitm_api_classify(FITM_ERR_FORMAT, FITM_API_COND_NONE).code, "invalid_json"));
    CHECK(fitm_api_classify(FITM_ERR_LIMIT, FITM_API_COND_NONE).http == 422);
    /* a prompt over the context: limit_exceeded on fitm's routes (http.c gives the OpenAI
     * routes OpenAI's 400 context_length_exceeded) */
    CHECK(fitm_api_classify(FITM_ERR_CONTEXT, FITM_API_COND_NONE).http == 422 &&
          !strcmp(fitm_api_classify(FITM_ERR_CONTEXT, FITM_API_COND_NONE).code, "limit_exceeded"));
    CHECK(fitm_api_classify(FITM_ERR_NOT_FOUND, FITM_API_COND_NONE).http == 404);
    CHECK(fitm_api_classify(FITM_ERR_BUSY, FITM_API_COND_NONE).http == 503);
    CHECK(fitm_api_classify(FITM_ERR_BUSY, FITM_API_COND_NONE).retry);
    CHECK(fitm_api_classify(FITM_ERR_TIMEOUT, FITM_API_COND_NONE).http == 503);
    CHECK(fitm_api_classify(FITM_ERR_BACKEND, FITM_API_COND_NONE).http == 500);
    CHECK(fitm_api_classify(FITM_OK, FITM_API_COND_NONE).http == 500);
    CHECK(fitm_api_classify(FITM_ERR_LIMIT, FITM_API_COND_BODY_TOO_LARGE).http == 413);
    CHECK(fitm_api_classify(FITM_ERR_INVALID, FITM_API_COND_UNAUTHORIZED).http == 401);
    CHECK(fitm_api_classify(FITM_ERR_INVALID, FITM_API_COND_METHOD).http == 405);
    CHECK(fitm_api_classify(FITM_ERR_INVALID, FITM_API_COND_MEDIA_TYPE).http == 415);
    for (int s = 1; s < FITM_STATUS_COUNT; s++) {
        fitm_api_error_class k = fitm_api_classify((fitm_status)s, FITM_API_COND_NONE);
        CHECK(k.http >= 400 && k.http < 600 && k.type && k.code);
    }
    char *j = fitm_api_error_json(&c, "bad \"x\"\n");
    CHECK(j && !strcmp(j, "{\"error\":{\"message\":\"bad \\\"x\\\"\\n\",\"type\":"
                          "\"invalid_request_error\",\"code\":\"invalid_value\"}}"));
    free(j);
}

static void test_utf8(void)
{
    CHECK(fitm_api_utf8_valid("abc", 3));
    CHECK(fitm_api_utf8_valid("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 9));
    CHECK(!fitm_api_utf8_valid("\xff", 1));
    CHECK(!fitm_api_utf8_valid("\xc0\xaf", 2));         /* overlong '/'       */
    CHECK(!fitm_api_utf8_valid("\xed\xa0\x80", 3));     /* surrogate          */
    CHECK(!fitm_api_utf8_valid("\xf4\x90\x80\x80", 4)); /* past U+10FFFF      */
    CHECK(!fitm_api_utf8_valid("\xe2\x82", 2));         /* truncated          */
}

static void test_parse(void)
{
    fitm_rerank_request req;
    fitm_err err = {{0}};
    const char *ok = "{\"query\":\"q\",\"documents\":[\"a\",{\"text\":\"b\",\"title\":\"T\"}],"
                     "\"top_n\":1,\"return_documents\":true,\"max_tokens_per_doc\":500,"
                     "\"model\":\"m\",\"method\":\"attention\",\"temperature\":0.5,"
                     "\"layers\":[0,-1],\"dummy\":\"zz\",\"return_tokens\":true,\"extra\":1}";
    CHECK(fitm_api_parse_rerank(ok, strlen(ok), &LIM, &req, &err) == FITM_OK);
    CHECK(req.n_docs == 2 && !strcmp(req.docs[1].title, "T") && !strcmp(req.docs[0].title, ""));
    CHECK(req.top_n == 1 && req.return_documents && req.return_tokens && !req.tei);
    CHECK(req.max_tokens_per_doc == 100); /* lowered to the server's limit */
    CHECK(req.method == FITM_RERANK_ATTENTION && req.opt.temperature == 0.5);
    CHECK(req.opt.n_layers == 2 && req.opt.layers[1] == -1 && !strcmp(req.dummy, "zz"));
    fitm_rerank_request_free(&req);

    const char *opts = "{\"query\":\"q\",\"documents\":[\"a\"],\"method\":\"paper\","
                       "\"rows\":\"suffix\",\"heads\":[[5,1],[-1,0]],\"aggregate\":\"mean\","
                       "\"skip_first\":2,\"reference\":\"both\",\"dummy_source\":\"documents\","
                       "\"form\":\"log_ratio\",\"sink_factor\":1.5,\"window\":3,"
                       "\"score_scale\":7,\"score_bias\":-1,\"layers\":null}";
    CHECK(fitm_api_parse_rerank(opts, strlen(opts), &LIM, &req, &err) == FITM_OK);
    CHECK(req.method == FITM_RERANK_PAPER && req.opt.rows == FITM_ROWS_SUFFIX);
    CHECK(req.opt.n_heads == 2 && req.opt.heads[0] == 5 && req.opt.heads[1] == 1 &&
          req.opt.heads[2] == -1 && req.opt.heads[3] == 0 && !req.opt.layers);
    CHECK(req.opt.aggregate == FITM_AGG_MEAN && req.opt.skip_first == 2 &&
          req.opt.reference == FITM_REF_BOTH && req.opt.dummy_source == FITM_DUMMY_DOCUMENTS);
    CHECK(req.opt.form == FITM_FORM_LOG_RATIO && req.opt.sink_factor == 1.5 &&
          req.opt.window == 3 && req.opt.score_scale == 7 && req.opt.score_bias == -1);
    fitm_rerank_request_free(&req);
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"rows\":\"all\"}", FITM_ERR_INVALID,
           "'rows'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"heads\":[[1,2,3]]}", FITM_ERR_INVALID,
           "'heads[0]'");
    /* a layer or head beyond an int, or not whole: refused before any conversion */
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"heads\":[[0,1],[1e110,0]]}",
           FITM_ERR_INVALID, "'heads[1]'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"heads\":[[0,-2147483649]]}",
           FITM_ERR_INVALID, "'heads[0]'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"heads\":[[0.5,1]]}", FITM_ERR_INVALID,
           "'heads[0]'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"heads\":[[-2147483648,2147483647]]}",
           FITM_ERR_INVALID, "'heads'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"window\":1.5}", FITM_ERR_INVALID,
           "'window'");
    /* cJSON would cut a string at \u0000: refused; an escaped backslash before u0000 is text */
    expect("{\"query\":\"q\\u0000x\",\"documents\":[\"a\"]}", FITM_ERR_INVALID, "NUL");
    expect("{\"query\":\"q\\\\u0000x\",\"documents\":[\"a\"]}", FITM_OK, NULL);

    const char *tei = "{\"query\":\"q\",\"texts\":[\"a\"],\"return_text\":true}";
    CHECK(fitm_api_parse_rerank(tei, strlen(tei), &LIM, &req, &err) == FITM_OK);
    CHECK(req.tei && req.return_documents && req.top_n == 1 && isnan(req.opt.temperature));
    CHECK(req.opt.rows == -1 && !req.opt.layers && req.opt.window == -1); /* the server's */
    fitm_rerank_request_free(&req);

    expect("{", FITM_ERR_FORMAT, "invalid JSON");
    expect("{} x", FITM_ERR_FORMAT, "trailing");
    expect("null", FITM_ERR_INVALID, "object");
    expect("{\"documents\":[\"a\"]}", FITM_ERR_INVALID, "'query' is missing");
    expect("{\"query\":\"\",\"documents\":[\"a\"]}", FITM_ERR_INVALID, "'query' is empty");
    expect("{\"query\":\"q\"}", FITM_ERR_INVALID, "'documents' is missing");
    expect("{\"query\":\"q\",\"documents\":[]}", FITM_ERR_INVALID, "'documents' is empty");
    expect("{\"query\":\"q\",\"documents\":[\"a\",\"a\",\"a\",\"a\",\"a\"]}", FITM_ERR_LIMIT,
           "more than the limit 4");
    expect("{\"query\":\"q\",\"documents\":[true]}", FITM_ERR_INVALID, "'documents[0]'");
    expect("{\"query\":\"q\",\"documents\":[{}]}", FITM_ERR_INVALID, "'documents[0].text'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"top_n\":-1}", FITM_ERR_INVALID, "'top_n'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"top_n\":1e300}", FITM_ERR_INVALID, "'top_n'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"method\":\"x\"}", FITM_ERR_INVALID,
           "'method'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"model\":\"n\"}", FITM_ERR_NOT_FOUND,
           "'model'");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"layers\":[1.5]}", FITM_ERR_INVALID,
           "'layers[0]'");
    expect("{\"query\":\"\xff\",\"documents\":[\"a\"]}", FITM_ERR_INVALID, "not valid UTF-8");
    expect("{\"query\":\"q\",\"documents\":[\"a\"],\"texts\":[\"a\"]}", FITM_ERR_INVALID, "not both");
    /* top_n past the documents is all of them; without strict_model any name is served. */
    {
        fitm_rerank_request req;
        fitm_err err = {{0}};
        fitm_api_limits lax = LIM;
        lax.strict_model = false;
        const char *b = "{\"query\":\"q\",\"documents\":[\"a\",\"b\"],\"top_n\":3,"
                        "\"model\":\"rerank-english-v3.0\"}";
        CHECK(fitm_api_parse_rerank(b, strlen(b), &lax, &req, &err) == FITM_OK && req.top_n == 2);
        fitm_rerank_request_free(&req);
        CHECK(fitm_api_parse_rerank(b, strlen(b), &LIM, &req, &err) == FITM_ERR_NOT_FOUND);
        fitm_rerank_request_free(&req);
    }
    /* Deep nesting must not crash the parser. */
    char deep[5000];
    memset(deep, '[', sizeof deep - 1);
    deep[sizeof deep - 1] = '\0';
    expect(deep, FITM_ERR_FORMAT, "invalid JSON");
}

static void test_write(void)
{
    fitm_rerank_request req;
    fitm_err err = {{0}};
    const char *body = "{\"query\":\"q\",\"documents\":[\"a\",\"b\",\"c\"],\"top_n\":2,"
                       "\"return_documents\":true}";
    CHECK(fitm_api_parse_rerank(body, strlen(body), &LIM, &req, &err) == FITM_OK);
    fitm_rerank_doc_result rs[3] = {{2, 0.5, 2, 0.1, 0.3, 0.2, 0.6, 0.0},
                                    {0, 0.3, 0, 0, 0.1, 0.1, 0.3, -0.85},
                                    {1, 0.2, 1, -0.1, 0.1, 0.2, 0.1, -1.39}};
    int32_t layers[2] = {0, 1};
    fitm_rerank_result res = {.results = rs, .n_results = 3,
                              .usage = {.prompt_tokens = 10, .forward_tokens = 25,
                                        .total_tokens = 10},
                              .meta = {.method = FITM_RERANK_CALIBRATED, .layers = layers,
                                       .n_layers = 2, .temperature = 5e-5}};
    char *j = fitm_api_write_rerank(&req, &res, "id1", "m");
    CHECK(j && strstr(j, "\"id\":\"id1\",\"model\":\"m\",\"results\":[{\"index\":2,"
                         "\"relevance_score\":0.5,\"document\":{\"text\":\"c\"},\"position\":2"));
    CHECK(j && !strstr(j, "\"index\":1")); /* cut to top_n */
    CHECK(j && strstr(j, "\"usage\":{\"prompt_tokens\":10,\"forward_tokens\":25,"
                         "\"total_tokens\":10}"));
    CHECK(j && strstr(j, "\"layers\":[0,1]") && strstr(j, "\"method\":\"calibrated\""));
    free(j);
    req.tei = true;
    j = fitm_api_write_rerank(&req, &res, "id1", "m");
    CHECK(j && !strcmp(j, "[{\"index\":2,\"score\":0.5,\"text\":\"c\"},{\"index\":0,\"score\":0.3,"
                          "\"text\":\"a\"}]"));
    free(j);
    fitm_rerank_request_free(&req);

    j = fitm_api_write_models("m", 5, 1024, "llama", false);
    CHECK(j && strstr(j, "\"id\":\"m\"") && strstr(j, "\"context_length\":1024") &&
          !strncmp(j, "{\"data\":[{", 10));
    free(j);
    j = fitm_api_write_models("m", 5, 1024, "llama", true);
    CHECK(j && !strncmp(j, "{\"id\":\"m\",\"object\":\"model\"", 26) && !strstr(j, "data"), "%s", j);
    free(j);
    j = fitm_api_write_health("ok", NULL);
    CHECK(j && !strcmp(j, "{\"status\":\"ok\"}"));
    free(j);
}

static void expect_answer(const char *body, fitm_status want_st, const char *want)
{
    fitm_answer_request req;
    fitm_err err = {{0}};
    fitm_status st = fitm_api_parse_answer(body, strlen(body), &LIM, &req, &err);
    if (st != want_st || (want && !strstr(err.msg, want))) {
        fprintf(stderr, "answer body %s: got %s '%s', want %s '%s'\n", body, fitm_status_name(st),
                err.msg, fitm_status_name(want_st), want ? want : "");
        failures++;
    }
    fitm_answer_request_free(&req);
}

static void test_answer(void)
{
    fitm_answer_request req;
    fitm_err err = {{0}};
    const char *all = "{\"query\":\"q\",\"documents\":[\"a\",{\"text\":\"b\",\"title\":\"t\"}],"
                      "\"max_tokens\":50,\"stop\":[\"\\n\",\"zz\"],\"temperature\":0.5,"
                      "\"top_p\":0.9,\"seed\":3,\"calibration\":{\"temperature\":0.001,\"window\":2,"
                      "\"layers\":[0,-1],\"dummy\":\"d\"},\"reorder\":\"query_likelihood\","
                      "\"reorder_placement\":\"last\",\"calibrate\":false,"
                      "\"intervention_layers\":[-1],\"stream\":true,\"method\":\"bogus\"}";
    CHECK(fitm_api_parse_answer(all, strlen(all), &LIM, &req, &err) == FITM_OK);
    CHECK(req.base.n_docs == 2 && req.n_stop == 2 && !strcmp(req.stop[1], "zz"));
    CHECK(req.max_tokens == LIM.max_answer_tokens); /* the server's limit itself */
    CHECK(req.temperature == 0.5 && req.top_p == 0.9 && req.seed == 3 && req.has_seed);
    CHECK(req.base.opt.temperature == 0.001 && req.base.opt.n_layers == 2 && req.base.dummy);
    CHECK(req.base.opt.window == 2 && req.base.opt.rows == -1);
    CHECK(req.reorder == FITM_RERANK_QUERY_LIKELIHOOD && req.calibrate == 0 && req.stream);
    CHECK(req.reorder_last == 1);
    CHECK(req.n_intervene_layers == 1 && req.intervene_layers[0] == -1);
    CHECK(req.base.method == FITM_RERANK_CALIBRATED); /* /rerank's fields are not /answer's */
    fitm_answer_request_free(&req);
    fitm_answer_request_free(NULL);

    const char *min = "{\"query\":\"q\",\"documents\":[\"a\"],\"stop\":\"x\",\"reorder\":\"none\"}";
    CHECK(fitm_api_parse_answer(min, strlen(min), &LIM, &req, &err) == FITM_OK);
    CHECK(req.temperature == 0 && req.top_p == 1 && !req.has_seed);
    CHECK(req.reorder == -1 && req.n_stop == 1 && !req.stream && req.max_tokens >= 1);
    /* Left out: the server's defaults, filled in by the pipeline. */
    CHECK(req.calibrate == FITM_ANSWER_UNSET && req.reorder_last == FITM_ANSWER_UNSET);
    CHECK(isnan(req.base.opt.temperature)); /* the server's default */
    char text[] = "a\xff"
                  "b";
    fitm_answer_result res = {.answer = text, .answer_len = 3, .n_docs = 0};
    char *j = fitm_api_write_answer(&req, &res, "id1", "m", 1, 2, true);
    CHECK(j && strstr(j, "\"answer\":\"a\xef\xbf\xbd"
                         "b\""));
    CHECK(j && strstr(j, "\"finish_reason\":\"stop\""));
    free(j);
    j = fitm_api_write_answer(&req, &res, "id1", "m", 1, 2, false);
    CHECK(j && !strstr(j, "\"answer\":") && strstr(j, "\"documents\":[]"));
    free(j);
    req.seed = UINT64_C(7108646760312380);
    j = fitm_api_write_answer(&req, &res, "id1", "m", 1, 2, true);
    CHECK(j && strstr(j, "\"seed\":7108646760312380,"));
    free(j);
    j = fitm_api_write_answer_delta("h\xc3", 2);
    CHECK(j && !strcmp(j, "{\"delta\":\"h\xef\xbf\xbd\"}"));
    free(j);
    fitm_answer_request_free(&req);

    expect_answer("{\"query\":\"q\",\"texts\":[\"a\"]}", FITM_ERR_INVALID, "'documents'");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"max_tokens\":0}", FITM_ERR_INVALID,
                  "'max_tokens'");
    /* Over the server's limit: refused naming it, not lowered. */
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"max_tokens\":51}", FITM_ERR_INVALID,
                  "limit of 50 tokens (max_answer_tokens)");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"stop\":[\"a\",3]}", FITM_ERR_INVALID,
                  "'stop[1]'");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"temperature\":-0.1}", FITM_ERR_INVALID,
                  "'temperature'");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"top_p\":0}", FITM_ERR_INVALID,
                  "'top_p'");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"calibration\":{\"layers\":[]}}",
                  FITM_ERR_INVALID, "'calibration.layers'");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"calibration\":{\"form\":\"x\"}}",
                  FITM_ERR_INVALID, "'calibration.form'");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"reorder\":\"x\"}", FITM_ERR_INVALID,
                  "'reorder'");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"],\"intervention_layers\":[600]}",
                  FITM_ERR_INVALID, "'intervention_layers[0]'");
    expect_answer("{\"query\":\"q\",\"documents\":[\"a\"]} x", FITM_ERR_FORMAT, "trailing");
    expect_answer("", FITM_ERR_FORMAT, "empty");
    expect_answer("[1]", FITM_ERR_INVALID, "object");
}

/* Bodies of many keys: every member counted (keys and elements, nested, none inside strings)
 * against max_json_members, and a key repeated anywhere in a large object found. */
static void test_json_members(void)
{
    fitm_api_limits lim = LIM;
    lim.max_json_members = 5000;
    fitm_rerank_request req;
    fitm_err err = {{0}};
    fitm_buf b = {0};
    for (int round = 0; round < 3; round++) {
        fitm_buf_clear(&b);
        /* 3 members (query, documents and its element), then n keys (their empty arrays add
         * none): 5000 in rounds 0 and 1 (where a key is repeated), 5001 in round 2 */
        int n = round == 2 ? 4998 : 4997;
        fitm_buf_printf(&b, "{\"query\":\"q,\\\"[{\",\"documents\":[\"a\"]");
        for (int i = 0; i < n; i++)
            fitm_buf_printf(&b, ",\"k%d\":[]", round == 1 && i == n - 1 ? 1234 : i);
        fitm_buf_printf(&b, "}");
        fitm_status st = fitm_api_parse_rerank(b.p, b.len, &lim, &req, &err);
        if (round == 0)
            CHECK(st == FITM_OK);
        else
            CHECK(st == FITM_ERR_INVALID &&
                  strstr(err.msg, round == 1 ? "duplicate key 'k1234'" : "max_json_members"));
        fitm_rerank_request_free(&req);
    }
    fitm_buf_free(&b);
}

int main(void)
{
    test_json_members();
    test_classify();
    test_utf8();
    test_parse();
    test_write();
    test_answer();
    if (failures) {
        fprintf(stderr, "test_api: %d failures\n", failures);
        return 1;
    }
    printf("test_api: ok\n");
    return 0;
}
