/* Unit test for config.c: defaults are valid, precedence flags > env > file > defaults, and
 * every bad value is rejected with a message that quotes it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "server/config.h"

static fitm_status load(fitm_config *cfg, fitm_err *err, int argc, char **argv)
{
    bool help = false;
    err->msg[0] = '\0';
    return fitm_config_load(cfg, argc, argv, &help, err);
}

static void expect_error(const char *substr, int argc, char **argv)
{
    fitm_config cfg;
    fitm_err err;
    fitm_status st = load(&cfg, &err, argc, argv);
    if (st != FITM_ERR_INVALID || !strstr(err.msg, substr)) {
        fprintf(stderr, "expected error containing '%s', got status %d '%s'\n", substr, st,
                err.msg);
        failures++;
    }
}

/* Replaces the file at path with text. */
static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "%s", path);
    if (!f)
        return;
    fputs(text, f);
    fclose(f);
}

int main(void)
{
    char path[] = "/tmp/fitm_test_config_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "# comment\n\nport = 9001\nthreads = 3\nhost = \"0.0.0.0\"\nlog_level = warn\n");
    fclose(f);

    fitm_config cfg;
    fitm_err err;
    unsetenv("FITM_PORT");
    unsetenv("FITM_CONFIG");
    char *a0[] = {"fitmd"};
    CHECK(load(&cfg, &err, 1, a0) == FITM_OK);
    CHECK(cfg.port == 8080 && cfg.queue_depth == 64 && !strcmp(cfg.backend, "auto"));
    CHECK(cfg.calib_temperature == 5e-5);

    /* file < env < flag */
    char *a1[] = {"fitmd", "--config", path};
    CHECK(load(&cfg, &err, 3, a1) == FITM_OK);
    CHECK(cfg.port == 9001 && cfg.threads == 3 && !strcmp(cfg.host, "0.0.0.0"));
    setenv("FITM_PORT", "9002", 1);
    CHECK(load(&cfg, &err, 3, a1) == FITM_OK);
    CHECK(cfg.port == 9002 && cfg.threads == 3);
    char *a2[] = {"fitmd", "--config", path, "--port=9003", "--queue-depth", "5"};
    CHECK(load(&cfg, &err, 6, a2) == FITM_OK);
    CHECK(cfg.port == 9003 && cfg.queue_depth == 5);
    unsetenv("FITM_PORT");

    /* errors quote the bad input */
    char *b1[] = {"fitmd", "--port", "99999"};
    expect_error("flag --port: port = '99999': must be between 1 and 65535", 3, b1);
    char *b2[] = {"fitmd", "--port", "80x"};
    expect_error("'80x': not an integer", 3, b2);
    char *b3[] = {"fitmd", "--backend", "tpu"};
    expect_error("backend = 'tpu': must be one of auto|cpu|cuda", 3, b3);
    char *b4[] = {"fitmd", "--no-such-thing", "1"};
    expect_error("unknown option '--no-such-thing'", 3, b4);
    char *b5[] = {"fitmd", "--port"};
    expect_error("option '--port' needs a value", 2, b5);
    char *b6[] = {"fitmd", "--calib-temperature", "nan"};
    expect_error("'nan': not a number", 3, b6);
    setenv("FITM_QUEUE_DEPTH", "0", 1);
    expect_error("environment FITM_QUEUE_DEPTH: queue_depth = '0'", 1, a0);
    unsetenv("FITM_QUEUE_DEPTH");

    write_text(path, "port = 1\nthreads = lots\n");
    char line2[512];
    snprintf(line2, sizeof line2, "%s:2: threads = 'lots': not an integer", path);
    expect_error(line2, 3, a1);
    write_text(path, "just words\n");
    expect_error(":1: 'just words': expected name = value", 3, a1);

    /* a comment after a value: after a blank, or after the closing quote */
    write_text(path, "api_keys = abc#1 # prod key\nmodel_name = \"fitm \"x\"\" # a \"name\"\n"
               "host = 0.0.0.0\t# all\nport = 9005 # main\ncors_origins = # none yet\n");
    CHECK(load(&cfg, &err, 3, a1) == FITM_OK, "%s", err.msg);
    CHECK(!strcmp(cfg.api_keys, "abc#1") && !strcmp(cfg.host, "0.0.0.0") && cfg.port == 9005,
          "'%s' '%s' %lld", cfg.api_keys, cfg.host, (long long)cfg.port);
    CHECK(!strcmp(cfg.model_name, "fitm \"x\""), "'%s'", cfg.model_name);
    CHECK(!strcmp(cfg.cors_origins, ""), "'%s'", cfg.cors_origins);
    write_text(path, "model_name = \"fitm\" extra\n");
    expect_error(":1: model_name: a quoted value may be followed only by a comment", 3, a1);

    /* /answer defaults and the default method are checked with the configuration (exit 2),
     * not when the model has loaded */
    char *b7[] = {"fitmd", "--rerank_method", "bogus"};
    expect_error("flag --rerank_method: rerank_method = 'bogus': must be one of", 3, b7);
    char *b8[] = {"fitmd", "--answer-top-n", "-1"};
    expect_error("flag --answer_top_n", 3, b8);
    setenv("FITM_ANSWER_REORDER_PLACEMENT", "middle", 1);
    expect_error("environment FITM_ANSWER_REORDER_PLACEMENT: answer_reorder_placement = 'middle'",
                 1, a0);
    unsetenv("FITM_ANSWER_REORDER_PLACEMENT");
    write_text(path, "answer_calibrate = maybe\n");
    expect_error(":1: answer_calibrate = 'maybe'", 3, a1);

    char *b10[] = {"fitmd", "--api_keys", " , ,"};
    expect_error("flag --api_keys: api_keys holds no key", 3, b10);
    char keys[33 * 8] = "";
    for (int i = 0; i < 33; i++)
        snprintf(keys + strlen(keys), sizeof keys - strlen(keys), "%sk%d", i ? ", " : "", i);
    char *b11[] = {"fitmd", "--api_keys", keys};
    expect_error("api_keys lists more than 32 keys", 3, b11);
    keys[strlen(keys) - 5] = '\0'; /* 32 keys */
    CHECK(load(&cfg, &err, 3, b11) == FITM_OK, "%s", err.msg);
    char *b9[] = {"fitmd", "--model_sha256", "nothex"};
    expect_error("flag --model_sha256: model_sha256 = 'nothex': must be 64 hex digits", 3, b9);

    /* a FITM_ variable that names no option is reported, the known ones are not */
    setenv("FITM_API_KEY", "secret", 1);
    setenv("FITM_PORT", "9006", 1);
    setenv("FITM_CPU", "baseline", 1);
    const char *unknown[4];
    int n_unknown = fitm_config_unknown_env(unknown, 4);
    CHECK(n_unknown == 1 && !strcmp(unknown[0], "FITM_API_KEY=secret"), "%d", n_unknown);
    unsetenv("FITM_API_KEY");
    unsetenv("FITM_PORT");
    unsetenv("FITM_CPU");
    CHECK(fitm_config_unknown_env(unknown, 4) == 0);

    /* the printed config file loads back to the same values */
    char *a3[] = {"fitmd", "--port", "7777", "--dummy-text", "some filler text"};
    CHECK(load(&cfg, &err, 5, a3) == FITM_OK);
    f = fopen(path, "w");
    fitm_config_print_file(f, &cfg);
    fclose(f);
    fitm_config back;
    CHECK(load(&back, &err, 3, a1) == FITM_OK);
    CHECK(back.port == 7777 && !strcmp(back.dummy_text, "some filler text"));
    CHECK(back.calib_temperature == cfg.calib_temperature);

    unlink(path);
    if (failures)
        return 1;
    printf("test_config: ok\n");
    return 0;
}
